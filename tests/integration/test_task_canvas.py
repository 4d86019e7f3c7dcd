"""A locked task inside Celery's canvas, on real workers: self.replace() and chains.

The workers fixture runs two prefork workers of two processes each, so what one
call publishes is picked up at once by another process.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from celery import Celery, chain, chord

from pglock_celery import lock_key
from tests.apps import core
from tests.support.workers import Worker


@pytest.fixture(params=["reuse", "connect", "shared"])
def strategy_queue(
    request: pytest.FixtureRequest,
    workers: list[Worker],
    app: Celery,
    worker_env: dict[str, str],
    log_dir: Path,
    queue: str,
) -> Iterator[str]:
    """The queue of two workers (two processes each) locking with the given strategy."""
    strategy = str(request.param)
    if strategy == "reuse":  # the session's workers: the default strategy
        yield queue
        return
    own = f"{queue}-{strategy}"
    env = {**worker_env, "PGLOCK_STRATEGY": strategy, "PGLOCK_TEST_QUEUE": own}
    started: list[Worker] = []
    try:
        for _ in range(2):
            started.append(Worker(app, "tests.apps.core", env, log_dir, concurrency=2))
        yield own
    finally:
        for worker in started:
            worker.stop()


def test_a_replacement_runs_because_the_lock_is_released_before_it_is_sent(
    strategy_queue: str, history: str, run_id: str
) -> None:
    result = core.replace_self.apply_async((f"replace-{run_id}", history), queue=strategy_queue)
    answer: Any = result.get(timeout=60)
    assert answer.get("stage") == "second", answer  # not {"skipped": True, ...}
    assert answer["ran"] is True


def held_by_another_worker(pg_dsn: str, name: str) -> psycopg.Connection[Any]:
    conn = psycopg.connect(pg_dsn, autocommit=True)
    conn.execute("SELECT pg_advisory_lock(%s)", (lock_key(name),))
    return conn


def test_a_chain_whose_first_step_skips_resolves_to_the_skip_result(
    workers: list[Worker], history: str, run_id: str, pg_dsn: str
) -> None:
    tenant = f"chain-{run_id}"
    other = held_by_another_worker(pg_dsn, f"tenant:{tenant}")
    try:
        result = chain(core.step.s(tenant, history), core.after.s(), core.after.s()).delay()
        answer = result.get(timeout=30)
        middle = result.parent.get(timeout=30)
        first = result.parent.parent.get(timeout=30)
    finally:
        other.close()
    assert answer["skipped"] is True and answer["lock"] == f"tenant:{tenant}"
    assert answer == middle == first  # every step's caller gets the skip's answer
    assert history_rows(pg_dsn, history) == 0  # and nothing after the skip ran


def test_a_chain_through_a_chord_whose_first_step_skips_resolves_to_the_skip_result(
    workers: list[Worker], history: str, run_id: str, pg_dsn: str
) -> None:
    tenant = f"chord-{run_id}"
    other = held_by_another_worker(pg_dsn, f"tenant:{tenant}")
    try:
        canvas = chain(
            core.step.s(tenant, history),
            chord([core.after.s(), core.after.s("other")], core.collect.s()),
        )
        answer = canvas.delay().get(timeout=30)
    finally:
        other.close()
    assert answer["skipped"] is True and answer["lock"] == f"tenant:{tenant}"


def test_a_chain_whose_first_step_runs_goes_on_as_usual(
    workers: list[Worker], history: str, run_id: str
) -> None:
    result = chain(core.step.s(f"free-{run_id}", history), core.after.s()).delay()
    answer = result.get(timeout=30)
    assert answer["after"]["ran"] is True


def history_rows(dsn: str, table: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(f"SELECT count(*) FROM {table}").fetchone()
    return int(row[0]) if row else -1
