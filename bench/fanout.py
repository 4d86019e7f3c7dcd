"""Section 4: how fast does the scan fan out, and what does a skipped call cost the worker?

``scan_due_tenants`` of the orchestrator dispatches 10,000 due tenants (one query,
then one producer pipelining its publishes to Redis); then a ``TenantLockedTask``
call whose lock another session holds, under each strategy, with and without the
holder report.

    python -m bench.fanout [--tenants 10000]

rewrites ``bench/results/fanout.json`` and renders BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import uuid
from typing import Any

import psycopg
import redis

from bench import cli
from bench.common import Context, close_sessions, strategies
from pglock_celery.config import PglockConfig
from pglock_celery.lock import AdvisoryLock

NAME, SECTION, TITLE = "fanout", "4", "scan fan-out and skip cost"
SKIPS = 300


def scan_fanout(base_dsn: str, broker: str, tenants: int) -> float:
    from celery._state import _set_task_join_will_block

    from tasks.run import prepare_database
    from tasks.schema import apply_schema

    schema = f"bench_{uuid.uuid4().hex[:6]}"
    dsn = prepare_database(base_dsn, schema)
    os.environ["PGLOCK_DSN"] = dsn
    try:
        apply_schema(dsn)
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(
                "INSERT INTO tenants (tenant_id) SELECT 't' || n FROM generate_series(1, %s) n",
                (tenants,),
            )
            # A bulk load, as a migration would do it: past the pipelines table's guard.
            conn.execute("SET pglock.guard = off")
            conn.execute("INSERT INTO pipelines (tenant_id) SELECT tenant_id FROM tenants")
        from tasks.celery_app import app
        from tasks.pipeline import scan_due_tenants

        queue = f"bench-scan-{uuid.uuid4().hex[:6]}"
        app.conf.update(broker_url=broker, result_backend=broker, pglock_dsn=dsn,
                        task_default_queue=queue)  # fmt: skip
        # The scan runs inside a worker, where Celery does not subscribe to each
        # sent task's result; measure it in the same conditions.
        _set_task_join_will_block(True)
        start = time.perf_counter()
        sent = scan_due_tenants()
        _set_task_join_will_block(False)
        elapsed = time.perf_counter() - start
        assert sent == tenants
        redis.Redis.from_url(broker).delete(queue)
        return elapsed
    finally:
        with psycopg.connect(base_dsn, autocommit=True) as conn:
            conn.execute(f"DROP SCHEMA {schema} CASCADE")


def skip_cost(dsn: str, strategy: str, report_holder: bool, count: int) -> float:
    """Worker milliseconds of one skipped call: the task's __call__ with the lock held elsewhere.

    The holder is a lock session of its own (``reuse``), as another worker's would
    be; a holder in the skipper's own ``shared`` registry would skip without asking
    the server.
    """
    from bench.app import app

    app.conf.pglock_dsn = dsn
    app.conf.pglock_strategy = strategy
    app.conf.pglock_report_holder = report_holder
    task = app.tasks["bench.app.locked"]
    holder = AdvisoryLock(f"tenant:{-999}", config=PglockConfig(dsn=dsn, strategy="reuse"))
    with holder as held:
        assert held.acquired
        for _ in range(20):
            assert task(-999)["skipped"]
        start = time.perf_counter()
        for _ in range(count):
            task(-999)
        elapsed = (time.perf_counter() - start) / count
    close_sessions()
    return elapsed * 1000


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tenants", type=int, default=10_000, help="due tenants to fan out")


def measure(ctx: Context, args: argparse.Namespace) -> dict[str, Any]:
    seconds = scan_fanout(ctx.dsn, ctx.broker, args.tenants)
    skips = [
        {
            "strategy": strategy,
            "reported": report,
            "ms": skip_cost(ctx.dsn, strategy, report, SKIPS),
        }
        for strategy in strategies(ctx.dsn)
        for report in (True, False)
    ]
    return {
        "tenants": args.tenants,
        "fanout_seconds": seconds,
        "skips_timed": SKIPS,
        "skips": skips,
    }


if __name__ == "__main__":
    sys.exit(cli.main([sys.modules[__name__]], "python -m bench.fanout", TITLE))
