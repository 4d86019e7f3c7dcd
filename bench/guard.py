"""Section 6: what does a guarded write cost, with 0 and 10,000 foreign locks?

A one-row UPDATE through a held lock's own connection, on a guarded table and on an
unguarded twin, measured in interleaved rounds while other sessions hold no advisory
lock and then 10,000 of them; plus a hand-rolled holder (plain ``pg_advisory_lock``),
whose check reads ``pg_locks``, and a 1,000-row UPDATE for the trigger's cost per row.

Runs alone in about 15 s, rewrites ``bench/results/guard.json`` and renders
BENCHMARKS.md::

    python -m bench.guard [--dsn DSN]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import uuid
from collections.abc import Callable
from typing import Any

import psycopg

from bench import cli
from bench.common import Context, ForeignLocks, no_arguments, timed
from pglock_celery import install_guard, lock_key
from pglock_celery.config import PglockConfig
from pglock_celery.lock import AdvisoryLock

NAME, SECTION, TITLE = "guard", "6", "guarded tables"
FOREIGN_LOCKS = 10_000
ROUNDS = 10
PER_ROUND = 200
#: The hand-rolled holder's write costs milliseconds with 10,000 locks: fewer samples.
HAND_ROLLED_PER_ROUND = 20
WIDE_PER_ROUND = 3
WIDE_ROWS = 1_000

UNGUARDED = "unguarded table, lock held"
GUARDED = "guarded table, library holder"
HAND_ROLLED = "guarded table, hand-rolled holder"


def measure_guard(dsn: str) -> dict[str, Any]:
    """p50 seconds of a one-row UPDATE and median seconds per row of a wide one."""
    tag = uuid.uuid4().hex[:6]
    schema = f"bench_guard_{tag}"
    template = f"bench:{tag}:{{tenant_id}}"
    with psycopg.connect(dsn, autocommit=True) as admin:
        admin.execute(f"CREATE SCHEMA {schema}")
        for table in ("plain", "guarded"):
            admin.execute(
                f"CREATE TABLE {schema}.{table} (id serial PRIMARY KEY, tenant_id text NOT NULL,"
                " n bigint NOT NULL DEFAULT 0)"
            )
            admin.execute(f"CREATE INDEX ON {schema}.{table} (tenant_id)")
            admin.execute(
                f"INSERT INTO {schema}.{table} (tenant_id) SELECT 't' || g"
                " FROM generate_series(1, 100) g"
            )
            admin.execute(
                f"INSERT INTO {schema}.{table} (tenant_id)"
                " SELECT 'wide' FROM generate_series(1, %s)",
                (WIDE_ROWS,),
            )
            admin.execute(f"VACUUM ANALYZE {schema}.{table}")
        install_guard(admin, f"{schema}.guarded", template)
    one_row: dict[tuple[str, int], list[float]] = {}
    per_row: dict[tuple[str, int], list[float]] = {}
    config = PglockConfig(dsn=dsn, strategy="connect")
    foreign = ForeignLocks(dsn)
    try:
        with (
            AdvisoryLock(template.format(tenant_id="t1"), config=config) as lock,
            AdvisoryLock(template.format(tenant_id="wide"), config=config) as wide,
            psycopg.connect(dsn, autocommit=True) as hand,
        ):
            assert lock.acquired and wide.acquired
            hand_key = lock_key(template.format(tenant_id="t2"))
            hand.execute("SELECT pg_advisory_lock(%s)", (hand_key,))
            writers: dict[str, Callable[[], object]] = {
                UNGUARDED: lambda: lock.connection.execute(
                    f"UPDATE {schema}.plain SET n = n + 1 WHERE tenant_id = 't1'"
                ),
                GUARDED: lambda: lock.connection.execute(
                    f"UPDATE {schema}.guarded SET n = n + 1 WHERE tenant_id = 't1'"
                ),
                HAND_ROLLED: lambda: hand.execute(
                    f"UPDATE {schema}.guarded SET n = n + 1 WHERE tenant_id = 't2'"
                ),
            }
            wide_writers: dict[str, Callable[[], object]] = {
                UNGUARDED: lambda: wide.connection.execute(
                    f"UPDATE {schema}.plain SET n = n + 1 WHERE tenant_id = 'wide'"
                ),
                GUARDED: lambda: wide.connection.execute(
                    f"UPDATE {schema}.guarded SET n = n + 1 WHERE tenant_id = 'wide'"
                ),
            }
            for once in [*writers.values(), *wide_writers.values()]:
                timed(once, 10)  # plans prepared, caches warm: not counted
            # Rounds alternate between the two lock counts, so that the noise of a shared
            # machine falls on both alike.
            for round_number in range(ROUNDS):
                levels = (0, FOREIGN_LOCKS) if round_number % 2 else (FOREIGN_LOCKS, 0)
                for locks in levels:
                    foreign.hold(locks)
                    for name, once in writers.items():
                        count = HAND_ROLLED_PER_ROUND if name == HAND_ROLLED else PER_ROUND
                        one_row.setdefault((name, locks), []).extend(timed(once, count))
                    for name, once in wide_writers.items():
                        seconds = [t / WIDE_ROWS for t in timed(once, WIDE_PER_ROUND)]
                        per_row.setdefault((name, locks), []).extend(seconds)
    finally:
        foreign.close()
        with psycopg.connect(dsn, autocommit=True) as admin:
            admin.execute(f"DROP SCHEMA {schema} CASCADE")
    return {
        "one_row": [
            {"writer": name, "locks": locks, "seconds": statistics.median(v)}
            for (name, locks), v in one_row.items()
        ],
        "per_row": [
            {"writer": name, "locks": locks, "seconds": statistics.median(v)}
            for (name, locks), v in per_row.items()
        ],
    }


add_arguments = no_arguments


def measure(ctx: Context, args: argparse.Namespace) -> dict[str, Any]:
    return {
        "foreign_locks": FOREIGN_LOCKS,
        "rounds": ROUNDS,
        "per_round": PER_ROUND,
        "hand_rolled_per_round": HAND_ROLLED_PER_ROUND,
        "wide_per_round": WIDE_PER_ROUND,
        "wide_rows": WIDE_ROWS,
        "writers": {"unguarded": UNGUARDED, "guarded": GUARDED, "hand_rolled": HAND_ROLLED},
        **measure_guard(ctx.dsn),
    }


if __name__ == "__main__":
    sys.exit(cli.main([sys.modules[__name__]], "python -m bench.guard", TITLE))
