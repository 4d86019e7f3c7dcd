"""Section 6 of `make bench`: the cost of a guarded write, with 0 and 10,000 foreign locks.

A one-row UPDATE through a held lock's own connection, on a guarded table and on an
unguarded twin, measured in interleaved rounds while other sessions hold no advisory
lock and then 10,000 of them; plus a hand-rolled holder (plain ``pg_advisory_lock``),
whose check reads ``pg_locks``, and a 1,000-row UPDATE for the trigger's cost per row.

Runs alone in about 15 s and rewrites only its own section of BENCHMARKS.md::

    python -m bench.guard [--dsn DSN] [--out BENCHMARKS.md]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psycopg

from bench.report import write_section
from bench.server import bench_postgres
from pglock_celery import install_guard, lock_key
from pglock_celery.config import PglockConfig
from pglock_celery.lock import AdvisoryLock

ROOT = Path(__file__).resolve().parents[1]
FOREIGN_LOCKS = 10_000
#: Foreign holders: the 10,000 locks are spread over this many sessions.
FOREIGN_SESSIONS = 10
ROUNDS = 10
PER_ROUND = 200
#: The hand-rolled holder's write costs milliseconds with 10,000 locks: fewer samples.
HAND_ROLLED_PER_ROUND = 20
WIDE_PER_ROUND = 3
WIDE_ROWS = 1_000
HEADING = "## 6. Guarded tables"

UNGUARDED = "unguarded table, lock held"
GUARDED = "guarded table, library holder"
HAND_ROLLED = "guarded table, hand-rolled holder"


@dataclass
class GuardFigures:
    #: (variant, foreign locks) -> p50 seconds of a one-row UPDATE.
    one_row: dict[tuple[str, int], float]
    #: (variant, foreign locks) -> median seconds per row of a 1,000-row UPDATE.
    per_row: dict[tuple[str, int], float]
    elapsed: float


class ForeignLocks:
    """Other sessions that hold 0 or ``FOREIGN_LOCKS`` advisory locks (none of them ours)."""

    def __init__(self, dsn: str) -> None:
        self.sessions = [psycopg.connect(dsn, autocommit=True) for _ in range(FOREIGN_SESSIONS)]

    def hold(self, count: int) -> None:
        """Hold ``count`` locks in all, instead of those held before."""
        per = count // FOREIGN_SESSIONS
        # Every session lets go first: the ranges of two counts overlap across sessions.
        for conn in self.sessions:
            conn.execute("SELECT pg_advisory_unlock_all()")
        for n, conn in enumerate(self.sessions):
            if per:
                conn.execute(
                    "SELECT count(pg_advisory_lock(k)) FROM generate_series(%s::int8, %s::int8) k",
                    (2**40 + n * per, 2**40 + (n + 1) * per - 1),
                )

    def close(self) -> None:
        for conn in self.sessions:
            conn.close()


def _timed(once: Callable[[], object], count: int) -> list[float]:
    samples = []
    for _ in range(count):
        began = time.perf_counter()
        once()
        samples.append(time.perf_counter() - began)
    return samples


def measure(dsn: str) -> GuardFigures:
    started = time.perf_counter()
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
                _timed(once, 10)  # plans prepared, caches warm: not counted
            # Rounds alternate between the two lock counts, so that the noise of a shared
            # machine falls on both alike.
            for round_number in range(ROUNDS):
                levels = (0, FOREIGN_LOCKS) if round_number % 2 else (FOREIGN_LOCKS, 0)
                for locks in levels:
                    foreign.hold(locks)
                    for name, once in writers.items():
                        count = HAND_ROLLED_PER_ROUND if name == HAND_ROLLED else PER_ROUND
                        one_row.setdefault((name, locks), []).extend(_timed(once, count))
                    for name, once in wide_writers.items():
                        seconds = [t / WIDE_ROWS for t in _timed(once, WIDE_PER_ROUND)]
                        per_row.setdefault((name, locks), []).extend(seconds)
    finally:
        foreign.close()
        with psycopg.connect(dsn, autocommit=True) as admin:
            admin.execute(f"DROP SCHEMA {schema} CASCADE")
    return GuardFigures(
        one_row={k: statistics.median(v) for k, v in one_row.items()},
        per_row={k: statistics.median(v) for k, v in per_row.items()},
        elapsed=time.perf_counter() - started,
    )


def render(figures: GuardFigures) -> list[str]:
    """The section's lines, for BENCHMARKS.md."""
    one, wide = figures.one_row, figures.per_row
    us = 1e6
    lines = [
        HEADING,
        "",
        f"A one-row `UPDATE` through the holder's connection (p50 of {ROUNDS * PER_ROUND};"
        f" {ROUNDS * HAND_ROLLED_PER_ROUND} for the hand-rolled holder), in rounds that"
        f" alternate between other sessions holding no advisory lock and {FOREIGN_LOCKS:,}:",
        "",
        f"| writer | 0 foreign locks | {FOREIGN_LOCKS:,} foreign locks |",
        "| --- | ---: | ---: |",
    ]
    for name in (UNGUARDED, GUARDED, HAND_ROLLED):
        lines.append(
            f"| {name} | {one[(name, 0)] * us:.0f} us | {one[(name, FOREIGN_LOCKS)] * us:.0f} us |"
        )
    ratio0 = one[(GUARDED, 0)] / one[(UNGUARDED, 0)]
    ratio10k = one[(GUARDED, FOREIGN_LOCKS)] / one[(UNGUARDED, FOREIGN_LOCKS)]
    flat = one[(GUARDED, FOREIGN_LOCKS)] / one[(GUARDED, 0)]
    hand = one[(HAND_ROLLED, FOREIGN_LOCKS)] / one[(HAND_ROLLED, 0)]
    wide0 = (wide[(GUARDED, 0)] - wide[(UNGUARDED, 0)]) * us
    wide10k = (wide[(GUARDED, FOREIGN_LOCKS)] - wide[(UNGUARDED, FOREIGN_LOCKS)]) * us
    lines += [
        "",
        f"Guarded against unguarded: {ratio0:.2f}x with no foreign lock, {ratio10k:.2f}x with"
        f" {FOREIGN_LOCKS:,} (target: within 1.3x); the guarded write with {FOREIGN_LOCKS:,}"
        f" foreign locks against none: {flat:.2f}x (target: flat). A library holder is"
        " recognised from its session's `pglock.held` setting and a"
        " `pg_try_advisory_xact_lock_shared` on the row's key, never from `pg_locks`. A"
        " hand-rolled holder's check reads `pg_locks` (a copy of the server's whole lock"
        f" table): {hand:.2f}x slower with {FOREIGN_LOCKS:,} foreign locks than with none.",
        "",
        f"The trigger's own cost, from a {WIDE_ROWS:,}-row `UPDATE` of one tenant's rows"
        f" (median of {ROUNDS * WIDE_PER_ROUND}): {wide0:.1f} us per row with no foreign lock,"
        f" {wide10k:.1f} us with {FOREIGN_LOCKS:,} (guarded"
        f" {wide[(GUARDED, 0)] * us:.1f} us per row, unguarded {wide[(UNGUARDED, 0)] * us:.1f}"
        " us). It builds the row's lock name, hashes it, reads one setting and takes a shared"
        " transaction lock, per row.",
        "",
    ]
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.guard", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--dsn", help="the database (default: PGLOCK_BENCH_DSN, else its own)")
    parser.add_argument("--out", default=str(ROOT / "BENCHMARKS.md"))
    args = parser.parse_args(argv)
    with contextlib.ExitStack() as stack:
        dsn = args.dsn or stack.enter_context(
            bench_postgres(Path(tempfile.mkdtemp(prefix="pglock-bench-")) / "pg")
        )
        figures = measure(dsn)
    lines = render(figures)
    print("\n".join(lines))
    note = (
        f"Measured alone by `python -m bench.guard` on {dt.date.today()} in"
        f" {figures.elapsed:.0f} s, on the machine of the sections above."
    )
    write_section(Path(args.out), lines, note)
    return 0


if __name__ == "__main__":
    sys.exit(main())
