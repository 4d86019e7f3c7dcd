"""Real workers on three shards (pglock_shards over three databases): tenants spread
over the shards and exclusive on each, every run on its tenant's own shard; a shard
that is down fails closed for its tenants only, the others run on."""

from __future__ import annotations

import random
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from celery import Celery
from psycopg.conninfo import make_conninfo

from pglock_celery import LockUnavailable
from pglock_celery.config import PglockConfig
from pglock_celery.keys import lock_key
from pglock_celery.shards import parse_shards
from tests.apps import core
from tests.support.history import Run, overlaps, read_history
from tests.support.services import free_port, own_database
from tests.support.shard_workers import history_everywhere, start_shard_workers
from tests.support.workers import Worker

RESULT_TIMEOUT = 60
#: The queue the shard workers alone listen on.
QUEUE = f"pglock-shard-tests-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def three(pg_dsn: str) -> Iterator[dict[str, str]]:
    with own_database(pg_dsn) as a, own_database(pg_dsn) as b, own_database(pg_dsn) as c:
        yield {"a": a, "b": b, "c": c}


@pytest.fixture
def table(three: dict[str, str]) -> str:
    """One history table, of one name, in every shard's database (dropped with them)."""
    return history_everywhere(three)


def shard_workers(
    app: Celery, worker_env: dict[str, str], log_dir: Path, shards: dict[str, str], count: int
) -> list[Worker]:
    return start_shard_workers(app, worker_env, log_dir, QUEUE, shards, count=count)


def shard_of(config: PglockConfig, tenant: str) -> str:
    return config.shard_of(lock_key(f"tenant:{tenant}"), f"tenant:{tenant}")


def test_tenants_spread_over_the_shards_and_are_exclusive_on_each(
    app: Celery,
    worker_env: dict[str, str],
    log_dir: Path,
    three: dict[str, str],
    table: str,
    run_id: str,
) -> None:
    """160 calls over 8 tenants on two prefork workers: every call ran or skipped, no
    two runs of a tenant overlap, and each ran on its tenant's shard alone."""
    config = PglockConfig(shards=parse_shards(three))
    tenants = [f"{run_id}-{n}" for n in range(8)]
    workers = shard_workers(app, worker_env, log_dir, three, 2)
    try:
        rng = random.Random(run_id)
        order = tenants * 20
        rng.shuffle(order)
        calls = [
            core.step.apply_async((t, table, rng.uniform(0.005, 0.05)), queue=QUEUE) for t in order
        ]
        results = [call.get(timeout=RESULT_TIMEOUT) for call in calls]
    finally:
        for worker in workers:
            worker.stop()
    ran = [r for r in results if isinstance(r, dict) and r.get("ran")]
    skipped = [r for r in results if isinstance(r, dict) and r.get("skipped")]
    assert len(ran) + len(skipped) == len(calls)
    assert skipped, "no call found its tenant locked: the test could not have failed"
    runs: list[Run] = []
    for shard, dsn in three.items():
        here = read_history(dsn, table)
        assert all(shard_of(config, run.lock_name.split(":", 1)[1]) == shard for run in here)
        runs.extend(here)
    assert len(runs) == len(ran)
    assert len({shard_of(config, t) for t in tenants}) >= 2, "the tenants did not spread"
    assert overlaps(runs) == []


def test_a_shard_that_is_down_fails_closed_for_its_tenants_and_the_others_run_on(
    app: Celery,
    worker_env: dict[str, str],
    log_dir: Path,
    three: dict[str, str],
    table: str,
    run_id: str,
) -> None:
    shards = {**three, "b": make_conninfo(three["b"], host="127.0.0.1", port=str(free_port()))}
    config = PglockConfig(shards=parse_shards(shards))
    tenants = [f"{run_id}-{n}" for n in range(40)]
    down = [t for t in tenants if shard_of(config, t) == "b"][:3]
    up = [t for t in tenants if shard_of(config, t) != "b"][:6]
    assert down and up
    workers = shard_workers(app, worker_env, log_dir, shards, 1)
    try:
        failed = [core.step.apply_async((t, table, 0), queue=QUEUE) for t in down]
        fine = [core.step.apply_async((t, table, 0), queue=QUEUE) for t in up]
        failures = [call.get(timeout=RESULT_TIMEOUT, propagate=False) for call in failed]
        results = [call.get(timeout=RESULT_TIMEOUT) for call in fine]
    finally:
        for worker in workers:
            worker.stop()
    assert all(isinstance(f, LockUnavailable) for f in failures), failures
    assert all(isinstance(r, dict) and r.get("ran") for r in results), results
    ran = {run.lock_name for dsn in (three["a"], three["c"]) for run in read_history(dsn, table)}
    assert ran == {f"tenant:{t}" for t in up}
    assert read_history(three["b"], table) == []
