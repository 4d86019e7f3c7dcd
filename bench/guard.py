"""Section 6: what does a guarded write cost, with 0 and 10,000 foreign locks?

A one-row UPDATE and a 10,000-row UPDATE of one tenant's rows, through a held lock's own
connection, on a guarded table and on an unguarded twin, measured in interleaved rounds
while other sessions hold no advisory lock and then 10,000 of them; plus a hand-rolled
holder (plain ``pg_advisory_lock``) of one row, whose check reads ``pg_locks``. Both
tables are vacuumed before each round, so that every round starts from the same state
(10,000-row UPDATEs leave as many dead rows behind).

Issue 26's targets, reported with the ratios (guarded over unguarded, each the median of
its samples; the spread is the ratio round by round): a one-row UPDATE within
``ONE_ROW_BOUND``, a 10,000-row one within ``WIDE_BOUND``. The figures are reports, not
a timed test: this machine's two cores are shared.

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
WIDE_ROWS = 10_000
#: Issue 26: guarded over unguarded, library holder, with 0 and with 10,000 foreign locks.
ONE_ROW_BOUND = 1.3
WIDE_BOUND = 1.5

UNGUARDED = "unguarded table, lock held"
GUARDED = "guarded table, library holder"
HAND_ROLLED = "guarded table, hand-rolled holder"

Samples = dict[tuple[str, int], list[list[float]]]


def measure_guard(dsn: str) -> dict[str, Any]:
    """Seconds of one-row and 10,000-row UPDATEs, per writer and lock level, round by round."""
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
    one_row: Samples = {}
    wide: Samples = {}
    config = PglockConfig(dsn=dsn, strategy="connect")
    foreign = ForeignLocks(dsn)
    try:
        with (
            AdvisoryLock(template.format(tenant_id="t1"), config=config) as lock,
            AdvisoryLock(template.format(tenant_id="wide"), config=config) as wide_lock,
            psycopg.connect(dsn, autocommit=True) as hand,
            psycopg.connect(dsn, autocommit=True) as vacuum,
        ):
            assert lock.acquired and wide_lock.acquired
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
                UNGUARDED: lambda: wide_lock.connection.execute(
                    f"UPDATE {schema}.plain SET n = n + 1 WHERE tenant_id = 'wide'"
                ),
                GUARDED: lambda: wide_lock.connection.execute(
                    f"UPDATE {schema}.guarded SET n = n + 1 WHERE tenant_id = 'wide'"
                ),
            }
            for once in [*writers.values(), *wide_writers.values()]:
                timed(once, 10)  # plans prepared, caches warm: not counted
            # Rounds alternate between the two lock counts, and the wide writers between
            # sample and sample, so that the noise of a shared machine falls on all alike.
            for round_number in range(ROUNDS):
                levels = (0, FOREIGN_LOCKS) if round_number % 2 else (FOREIGN_LOCKS, 0)
                for locks in levels:
                    for table in ("plain", "guarded"):
                        vacuum.execute(f"VACUUM {schema}.{table}")
                    foreign.hold(locks)
                    for name, once in writers.items():
                        count = HAND_ROLLED_PER_ROUND if name == HAND_ROLLED else PER_ROUND
                        one_row.setdefault((name, locks), []).append(timed(once, count))
                    this_round: dict[str, list[float]] = {name: [] for name in wide_writers}
                    order = list(wide_writers.items())
                    for sample in range(WIDE_PER_ROUND):
                        for name, once in order if sample % 2 else order[::-1]:
                            this_round[name] += timed(once, 1)
                    for name, seconds in this_round.items():
                        wide.setdefault((name, locks), []).append(seconds)
    finally:
        foreign.close()
        with psycopg.connect(dsn, autocommit=True) as admin:
            admin.execute(f"DROP SCHEMA {schema} CASCADE")
    return {
        "one_row": medians(one_row),
        # Per row of the wide UPDATE: what bench.report renders as the trigger's cost.
        "per_row": [{**row, "seconds": row["seconds"] / WIDE_ROWS} for row in medians(wide)],
        "wide": medians(wide),
        "ratios": [
            *ratios("one-row UPDATE", one_row, ONE_ROW_BOUND),
            *ratios(f"{WIDE_ROWS:,}-row UPDATE", wide, WIDE_BOUND),
        ],
    }


def median(rounds: list[list[float]]) -> float:
    """The median of every round's samples together."""
    return statistics.median(seconds for samples in rounds for seconds in samples)


def medians(samples: Samples) -> list[dict[str, Any]]:
    """Per writer and lock level, the median of its samples."""
    return [
        {"writer": name, "locks": locks, "seconds": median(rounds)}
        for (name, locks), rounds in samples.items()
    ]


def ratios(measure: str, samples: Samples, bound: float) -> list[dict[str, Any]]:
    """Guarded over unguarded per lock level: of the medians, and round by round (spread)."""
    found = []
    for locks in (0, FOREIGN_LOCKS):
        guarded, unguarded = samples[(GUARDED, locks)], samples[(UNGUARDED, locks)]
        by_round = sorted(
            statistics.median(g) / statistics.median(u)
            for g, u in zip(guarded, unguarded, strict=True)
        )
        ratio = median(guarded) / median(unguarded)
        found.append(
            {
                "measure": measure,
                "locks": locks,
                "guarded": median(guarded),
                "unguarded": median(unguarded),
                "ratio": ratio,
                "round_min": by_round[0],
                "round_max": by_round[-1],
                "bound": bound,
                "met": ratio <= bound,
            }
        )
    return found


def report(found: list[dict[str, Any]]) -> list[str]:
    """One line per target, for the console."""
    return [
        f"{r['measure']}, {r['locks']:,} foreign locks: guarded {r['guarded'] * 1e6:,.0f} us,"
        f" unguarded {r['unguarded'] * 1e6:,.0f} us: {r['ratio']:.2f}x (rounds"
        f" {r['round_min']:.2f}x to {r['round_max']:.2f}x); target <= {r['bound']}x:"
        f" {'met' if r['met'] else 'MISSED'}"
        for r in found
    ]


add_arguments = no_arguments


def measure(ctx: Context, args: argparse.Namespace) -> dict[str, Any]:
    figures = measure_guard(ctx.dsn)
    for line in report(figures["ratios"]):
        print(f"  {line}", flush=True)
    return {
        "foreign_locks": FOREIGN_LOCKS,
        "rounds": ROUNDS,
        "per_round": PER_ROUND,
        "hand_rolled_per_round": HAND_ROLLED_PER_ROUND,
        "wide_per_round": WIDE_PER_ROUND,
        "wide_rows": WIDE_ROWS,
        "writers": {"unguarded": UNGUARDED, "guarded": GUARDED, "hand_rolled": HAND_ROLLED},
        **figures,
    }


if __name__ == "__main__":
    sys.exit(cli.main([sys.modules[__name__]], "python -m bench.guard", TITLE))
