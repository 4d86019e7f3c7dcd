"""Section 5: how many lock sessions does a worker keep open, at peak and after?

One worker of 4 processes per strategy runs 4 locked calls of a second at once;
its lock sessions are counted by the run's own ``pglock_application_name``
prefix while they run, and once they are done.

    python -m bench.peak

rewrites ``bench/results/peak.json`` and renders BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import sys
import time
import uuid
from typing import Any

import psycopg

from bench import cli
from bench.common import Context, no_arguments, settled, strategies
from bench.workers import worker
from pglock_celery.config import PglockConfig

NAME, SECTION, TITLE = "peak", "5", "connections at peak"
RUNNING = 4


def peak_connections(dsn: str, running: int, queue: str, prefix: str) -> tuple[int, int]:
    """(lock sessions at peak while ``running`` calls run, sessions left open after).

    Counts only the sessions of this run's workers: their application_name prefix.
    """
    from bench.app import app

    def lock_sessions() -> int:
        with psycopg.connect(dsn) as conn:
            row = conn.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name LIKE %s",
                (prefix + "%",),
            ).fetchone()
        return int(row[0]) if row else 0

    calls = [app.tasks["bench.app.hold"].apply_async((i, 1.0), queue=queue) for i in range(running)]
    peak = 0
    while not all(call.ready() for call in calls):
        peak = max(peak, lock_sessions())
        time.sleep(0.02)  # sampling rate of the probe
    return peak, settled(lock_sessions)


add_arguments = no_arguments


def measure(ctx: Context, args: argparse.Namespace) -> dict[str, Any]:
    env = {"PGLOCK_DSN": ctx.dsn, "PGLOCK_BENCH_BROKER": ctx.broker}
    peaks = []
    for strategy in strategies(ctx.dsn):
        prefix = f"pgb{uuid.uuid4().hex[:8]}"
        queue = f"pglock-bench-{prefix}"
        queue_env = {
            **env,
            "PGLOCK_STRATEGY": strategy,
            "PGLOCK_BENCH_QUEUE": queue,
            "PGLOCK_APPLICATION_NAME": prefix,
        }
        with worker(queue_env, ctx.work, concurrency=RUNNING):
            peak, left = peak_connections(ctx.dsn, RUNNING, queue, prefix)
        peaks.append({"strategy": strategy, "peak": peak, "left": left})
    defaults = PglockConfig(dsn=ctx.dsn)
    return {
        "running": RUNNING,
        "processes": RUNNING,
        "idle_sessions": defaults.idle_sessions,
        "shared_sessions": defaults.shared_sessions,
        "peaks": peaks,
    }


if __name__ == "__main__":
    sys.exit(cli.main([sys.modules[__name__]], "python -m bench.peak", TITLE))
