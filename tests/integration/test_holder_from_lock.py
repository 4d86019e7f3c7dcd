"""Who holds a lock is read from the lock: a session that only waits for it (its name and
task id already set, as under ``connect``) is never reported as its holder, and a call is
never dropped as a redelivered copy because a session carrying its task id waits (real
`celery worker` processes under each dedicated strategy, a hand-rolled holder)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from celery import Celery
from celery.result import AsyncResult

from pglock_celery import lock_key, skipped
from tests.apps import core
from tests.integration.test_workers import waiting_sessions
from tests.support.history import read_history
from tests.support.services import wait_until
from tests.support.workers import Worker

RESULT_TIMEOUT = 30
IGNORED = "a redelivered copy, ignored"


@pytest.fixture(scope="module", params=["connect", "reuse"])
def strategy_worker(
    request: pytest.FixtureRequest, app: Celery, worker_env: dict[str, str], log_dir: Path
) -> Iterator[tuple[Worker, str]]:
    """A prefork worker of two processes (one waits, one skips) under a strategy."""
    queue = f"{worker_env['PGLOCK_TEST_QUEUE']}-holder-{request.param}"
    env = {**worker_env, "PGLOCK_TEST_QUEUE": queue, "PGLOCK_STRATEGY": request.param}
    worker = Worker(app, "tests.apps.core", env, log_dir, concurrency=2)
    try:
        yield worker, queue
    finally:
        worker.stop()


@pytest.fixture
def hand_rolled(pg_dsn: str) -> Iterator[tuple[psycopg.Connection, int]]:
    """A plain session (no library name) that the test uses to hold a key; its backend pid."""
    with psycopg.connect(pg_dsn, autocommit=True, application_name="hand-rolled") as conn:
        yield conn, conn.info.backend_pid


def hold_with_a_waiter(
    conn: psycopg.Connection, pg_dsn: str, queue: str, tenant: str, history: str, waiter_id: str
) -> None:
    """The hand-rolled session holds the tenant's key; a `wait` call queues behind it."""
    key = lock_key(f"tenant:{tenant}")
    conn.execute("SELECT pg_advisory_lock(%s)", (key,))
    core.wait_step.apply_async((tenant, history), queue=queue, task_id=waiter_id)
    wait_until(lambda: waiting_sessions(pg_dsn, key) == 1, 20, "the wait call to queue")


def let_the_waiter_run(conn: psycopg.Connection, pg_dsn: str, tenant: str, history: str) -> None:
    conn.execute("SELECT pg_advisory_unlock_all()")
    name = f"tenant:{tenant}"
    wait_until(
        lambda: [r for r in read_history(pg_dsn, history) if r.lock_name == name and r.finished],
        RESULT_TIMEOUT,
        "the waiting call to run once the key is free",
    )


def test_a_skip_names_the_session_holding_the_key_never_one_waiting_for_it(
    strategy_worker: tuple[Worker, str],
    hand_rolled: tuple[psycopg.Connection, int],
    history: str,
    pg_dsn: str,
    run_id: str,
) -> None:
    worker, queue = strategy_worker
    conn, holder_backend = hand_rolled
    tenant, waiter_id = f"{run_id}-waited", str(uuid.uuid4())
    hold_with_a_waiter(conn, pg_dsn, queue, tenant, history, waiter_id)
    try:
        result = core.step.apply_async((tenant, history), queue=queue).get(timeout=RESULT_TIMEOUT)
        assert skipped(result), result
        assert result["holder"] is not None, "the holder holds the key: it can be found"
        assert result["holder"]["task_id"] != waiter_id, f"a waiter named as holder: {result}"
        assert result["holder"]["backend_pid"] == holder_backend, result
        assert result["holder"]["task_id"] is None
    finally:
        let_the_waiter_run(conn, pg_dsn, tenant, history)
    assert IGNORED not in worker.log.read_text(errors="replace")


def test_a_call_whose_task_id_only_waits_for_the_lock_skips_and_stores_its_result(
    strategy_worker: tuple[Worker, str],
    hand_rolled: tuple[psycopg.Connection, int],
    history: str,
    pg_dsn: str,
    run_id: str,
) -> None:
    """A copy is dropped only when its first delivery holds the lock; here another holds it,
    and a session carrying the call's task id only waits: the call skips, its result stored."""
    worker, queue = strategy_worker
    conn, holder_backend = hand_rolled
    tenant, task_id = f"{run_id}-own-id-waits", str(uuid.uuid4())
    hold_with_a_waiter(conn, pg_dsn, queue, tenant, history, task_id)
    try:
        core.step.apply_async((tenant, history), queue=queue, task_id=task_id)
        call = AsyncResult(task_id, app=core.app)
        wait_until(
            lambda: call.ready() or f"[{task_id}] itself: {IGNORED}" in worker.log.read_text(),
            RESULT_TIMEOUT,
            "the call to end or be dropped",
        )
        assert call.ready(), f"the call was dropped as a redelivered copy:\n{worker.log_tail()}"
        result = call.get(timeout=1)
        assert skipped(result), result
        assert result["holder"] is not None
        assert result["holder"]["backend_pid"] == holder_backend, result
    finally:
        let_the_waiter_run(conn, pg_dsn, tenant, history)
