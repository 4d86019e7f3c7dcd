"""Section 9: what does a fenced ORM write cost (``pglock_database``), against an unfenced one?

One ``Model.objects.create()`` per locked call, and 100 in one ``atomic()``, written
through the fence (the lock's session, fenced_orm) and through Django's own connection
with the same lock held (unfenced), in interleaved rounds; Django configured in this
process with the bench database as its ``default`` alias. Round trips are counted from
libpq's own trace of the connection that writes (each simple Query or Sync is one wait
for the server), the lock's own acquire and release aside.

Issue 35's target, reported with the figures: a fenced autocommit write costs at most
twice the round trips of an unfenced one. The figures are reports, not a timed test.

Runs alone in about 20 s, rewrites ``bench/results/orm.json`` and renders
BENCHMARKS.md::

    python -m bench.orm [--dsn DSN]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
from psycopg import pq
from psycopg.conninfo import conninfo_to_dict

from bench import cli
from bench.common import Context, no_arguments, timed
from pglock_celery.config import PglockConfig
from pglock_celery.lock import AdvisoryLock

NAME, SECTION, TITLE = "orm", "9", "fenced ORM writes"
ROUNDS = 10
PER_ROUND = 30
BATCH = 100
#: Issue 35: fenced over unfenced round trips of one autocommit write, at most.
ROUND_TRIP_BOUND = 2.0


def _django(dsn: str) -> Any:
    """Django configured in this process, DATABASES["default"] the bench database; the model."""
    import django
    from django.conf import settings

    params = conninfo_to_dict(dsn)
    if not settings.configured:
        settings.configure(
            DATABASES={
                "default": {
                    "ENGINE": "django.db.backends.postgresql",
                    "NAME": params.get("dbname", ""),
                    "USER": params.get("user", ""),
                    "PASSWORD": params.get("password", ""),
                    "HOST": params.get("host", ""),
                    "PORT": params.get("port", ""),
                }
            },
            USE_TZ=True,
            INSTALLED_APPS=[],
        )
        django.setup()
    from django.db import models

    class Row(models.Model):
        tenant = models.TextField()

        class Meta:
            app_label = "bench_orm"
            db_table = f"bench_orm_{uuid.uuid4().hex[:6]}"

    return Row


@contextlib.contextmanager
def _traced(pgconn: pq.abc.PGconn, seen: list[int]) -> Iterator[None]:
    """Count the round trips on ``pgconn`` meanwhile (appended to ``seen``)."""
    with tempfile.TemporaryFile("w+") as trace:
        pgconn.trace(trace.fileno())
        pgconn.set_trace_flags(pq.Trace.SUPPRESS_TIMESTAMPS | pq.Trace.REGRESS_MODE)
        try:
            yield
        finally:
            pgconn.untrace()
        trace.seek(0)
        fields = [line.split("\t") for line in trace.read().splitlines()]
    seen.append(sum(f[0] == "F" and len(f) > 2 and f[2] in ("Query", "Sync") for f in fields))


def measure_orm(dsn: str) -> dict[str, Any]:
    """Seconds and round trips per locked call, fenced and unfenced, one write and a batch."""
    row = _django(dsn)
    from django.db import connection, transaction

    from pglock_celery.django.fence import fenced_orm

    table = row._meta.db_table
    with connection.schema_editor() as editor:
        editor.create_model(row)
    config = PglockConfig(dsn=dsn, database="default")  # as pglock_database makes it
    name = f"bench:orm:{uuid.uuid4().hex[:6]}"

    def one() -> None:
        row.objects.create(tenant="t")

    def batch() -> None:
        with transaction.atomic():
            for _ in range(BATCH):
                row.objects.create(tenant="t")

    def fenced(write: Callable[[], None], trips: list[int] | None = None) -> Callable[[], None]:
        def call() -> None:
            with AdvisoryLock(name, config=config) as lock:
                assert lock.acquired
                with fenced_orm(lock, "default"):
                    if trips is None:
                        write()
                    else:
                        with _traced(lock.connection.pgconn, trips):
                            write()

        return call

    def unfenced(write: Callable[[], None], trips: list[int] | None = None) -> Callable[[], None]:
        def call() -> None:
            with AdvisoryLock(name, config=config) as lock:
                assert lock.acquired
                if trips is None:
                    write()
                else:
                    connection.ensure_connection()
                    with _traced(connection.connection.pgconn, trips):
                        write()

        return call

    try:
        writers = {
            ("one", "fenced"): fenced(one),
            ("one", "unfenced"): unfenced(one),
            ("batch", "fenced"): fenced(batch),
            ("batch", "unfenced"): unfenced(batch),
        }
        trips: dict[tuple[str, str], list[int]] = {key: [] for key in writers}
        for (what, how), _ in writers.items():
            make = fenced if how == "fenced" else unfenced
            write = one if what == "one" else batch
            for _ in range(3):
                make(write, trips[(what, how)])()
        for once in writers.values():
            timed(once, 5)  # plans prepared, caches warm: not counted
        samples: dict[tuple[str, str], list[float]] = {key: [] for key in writers}
        order = list(writers.items())
        for round_number in range(ROUNDS):
            for key, once in order if round_number % 2 else order[::-1]:
                count = PER_ROUND if key[0] == "one" else max(1, PER_ROUND // 10)
                samples[key] += timed(once, count)
    finally:
        with connection.schema_editor() as editor:
            editor.delete_model(row)
        connection.close()
        with psycopg.connect(dsn, autocommit=True) as admin:
            admin.execute(f'DROP TABLE IF EXISTS "{table}"')
    figures = []
    for what in ("one", "batch"):
        writes = 1 if what == "one" else BATCH
        f_s = statistics.median(samples[(what, "fenced")])
        u_s = statistics.median(samples[(what, "unfenced")])
        f_trips, u_trips = max(trips[(what, "fenced")]), max(trips[(what, "unfenced")])
        figures.append(
            {
                "writes": writes,
                "fenced_seconds": f_s,
                "unfenced_seconds": u_s,
                "fenced_round_trips": f_trips,
                "unfenced_round_trips": u_trips,
                "ratio": f_s / u_s,
                "round_trip_ratio": f_trips / u_trips,
            }
        )
    return {"figures": figures, "bound": ROUND_TRIP_BOUND}


def report(d: dict[str, Any]) -> list[str]:
    """One line per measure, for the console."""
    return [
        f"{r['writes']} write(s) per locked call: fenced {r['fenced_seconds'] * 1e3:.2f} ms,"
        f" {r['fenced_round_trips']} round trips; unfenced {r['unfenced_seconds'] * 1e3:.2f} ms,"
        f" {r['unfenced_round_trips']} round trips: {r['ratio']:.2f}x the time,"
        f" {r['round_trip_ratio']:.2f}x the round trips"
        for r in d["figures"]
    ]


add_arguments = no_arguments


def measure(ctx: Context, args: argparse.Namespace) -> dict[str, Any]:
    figures = measure_orm(ctx.dsn)
    for line in report(figures):
        print(f"  {line}", flush=True)
    return {"rounds": ROUNDS, "per_round": PER_ROUND, "batch": BATCH, **figures}


if __name__ == "__main__":
    sys.exit(cli.main([sys.modules[__name__]], "python -m bench.orm", TITLE))
