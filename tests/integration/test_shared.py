"""Strategy shared: many holders of one process on a few sessions, never one name twice."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from celery import Celery

from pglock_celery import LockLost, PglockError, install_guard, lock_key, remove_guard
from pglock_celery.config import PglockConfig
from pglock_celery.lock import AdvisoryLock
from pglock_celery.sources import registry
from tests.apps import core
from tests.helpers.history import overlaps, read_history
from tests.helpers.services import wait_until
from tests.helpers.workers import Worker

RESULT_TIMEOUT = 120


@pytest.fixture(autouse=True)
def no_shared_sessions_left() -> Iterator[None]:
    yield
    registry.close()


def lock(dsn: str, name: str, **config: Any) -> AdvisoryLock:
    settings: dict[str, Any] = {
        "dsn": dsn, "strategy": "shared", "check_interval": 0.2, **config,
    }  # fmt: skip
    return AdvisoryLock(name, config=PglockConfig(**settings))


def shared_backends(dsn: str, worker_pid: int) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name LIKE %s",
            (f"pglock-shared|{worker_pid}|%",),
        ).fetchone()
    return int(row[0]) if row else 0


def free_elsewhere(dsn: str, name: str) -> bool:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT pg_try_advisory_lock(%s)", (lock_key(name),)).fetchone()
    return bool(row and row[0])


def test_two_hundred_threads_hold_distinct_names_on_at_most_four_sessions(
    pg_dsn: str, run_id: str
) -> None:
    held = [lock(pg_dsn, f"t:{run_id}:{n}") for n in range(200)]
    barrier = threading.Barrier(len(held) + 1)

    def hold(one: AdvisoryLock) -> None:
        assert one.acquire()
        barrier.wait(30)  # all held at once
        barrier.wait(30)
        one.release()

    threads = [threading.Thread(target=hold, args=(one,)) for one in held]
    for thread in threads:
        thread.start()
    barrier.wait(30)
    try:
        assert registry.shared_count() <= 4
        assert shared_backends(pg_dsn, os.getpid()) <= 4
        assert not free_elsewhere(pg_dsn, f"t:{run_id}:7")
    finally:
        barrier.wait(30)
        for thread in threads:
            thread.join(30)
    assert free_elsewhere(pg_dsn, f"t:{run_id}:7")


def test_a_second_holder_in_the_process_sees_the_name_held(pg_dsn: str, run_id: str) -> None:
    with lock(pg_dsn, f"t:{run_id}", shared_sessions=1) as first:
        assert first.acquired
        with lock(pg_dsn, f"t:{run_id}", shared_sessions=1) as second:
            assert not second.acquired  # same session, re-entrant: the registry says no
    with lock(pg_dsn, f"t:{run_id}") as third:
        assert third.acquired


def test_a_waiting_holder_gets_the_name_once_the_first_lets_go(pg_dsn: str, run_id: str) -> None:
    first = lock(pg_dsn, f"t:{run_id}")
    assert first.acquire()
    got: list[float] = []

    def waiter() -> None:
        with AdvisoryLock(
            f"t:{run_id}",
            config=PglockConfig(dsn=pg_dsn, strategy="shared"),
            wait=True,
            timeout=10,
        ) as second:
            got.append(time.monotonic())
            assert second.acquired

    thread = threading.Thread(target=waiter)
    thread.start()
    time.sleep(0.3)  # the scenario itself: the waiter waits while the first holds
    assert not got
    released = time.monotonic()
    first.release()
    thread.join(10)
    assert got and got[0] >= released


def test_a_failed_shared_session_loses_every_lock_on_it_at_once(pg_dsn: str, run_id: str) -> None:
    held = [lock(pg_dsn, f"t:{run_id}:{n}", shared_sessions=1) for n in range(5)]
    for one in held:
        assert one.acquire()
    backend = held[0].backend_pid
    held[0].sleep(0.5)  # past one check interval: monitors run
    with psycopg.connect(pg_dsn, autocommit=True) as admin:
        admin.execute("SELECT pg_terminate_backend(%s)", (backend,))
    wait_until(lambda: all(one.lost_reason for one in held), 3, "every lock to be marked lost")
    for one in held:
        with pytest.raises(LockLost):
            one.release()
    with lock(pg_dsn, f"t:{run_id}:0", shared_sessions=1) as again:  # a new session
        assert again.acquired


def test_writes_go_through_transaction_and_leave_the_session_clean(
    pg_dsn: str, run_id: str
) -> None:
    table = f"shared_{run_id}"
    with psycopg.connect(pg_dsn, autocommit=True) as admin:
        admin.execute(f"CREATE TABLE {table} (tenant text, v int)")
    install_guard(pg_dsn, table, "t:{tenant}")
    try:
        with lock(pg_dsn, f"t:{run_id}", shared_sessions=1) as held:
            with pytest.raises(PglockError, match=r"lock\.transaction\(\)"):
                held.connection  # noqa: B018
            with held.transaction() as conn:
                conn.execute(f"INSERT INTO {table} VALUES (%s, 1)", (run_id,))
                conn.execute("SET statement_timeout = 4321")  # session-level, inside
            with lock(pg_dsn, f"t:{run_id}-other", shared_sessions=1) as other:
                with other.transaction() as conn:
                    shown = conn.execute("SHOW statement_timeout").fetchone()
                    assert shown == ("0",)
                    with (
                        pytest.raises(psycopg.ProgrammingError, match="pglock"),
                        conn.transaction(),
                    ):
                        # the guard: another tenant's row, whose lock this holder lacks
                        conn.execute(f"INSERT INTO {table} VALUES (%s, 2)", (f"{run_id}-x",))
        with psycopg.connect(pg_dsn) as check:
            rows = check.execute(f"SELECT tenant, v FROM {table}").fetchall()
        assert rows == [(run_id, 1)]
    finally:
        remove_guard(pg_dsn, table)
        with psycopg.connect(pg_dsn, autocommit=True) as admin:
            admin.execute(f"DROP TABLE {table}")


@pytest.fixture(
    scope="module", params=[("gevent", 500), ("threads", 50)], ids=["gevent", "threads"]
)
def shared_worker(
    request: pytest.FixtureRequest, app: Celery, worker_env: dict[str, str], log_dir: Path
) -> Iterator[Worker]:
    """One worker whose calls share lock sessions, on a queue of its own."""
    pool, concurrency = request.param
    env = {
        **worker_env,
        "PGLOCK_TEST_QUEUE": f"{worker_env['PGLOCK_TEST_QUEUE']}-shared-{pool}",
        "PGLOCK_STRATEGY": "shared",
    }
    worker = Worker(app, "tests.apps.core", env, log_dir, pool=pool, concurrency=concurrency)
    yield worker
    worker.stop()


def test_a_pool_of_hundreds_shares_four_sessions_and_never_overlaps(
    shared_worker: Worker, queue: str, history: str, pg_dsn: str, run_id: str
) -> None:
    pool = shared_worker.pool
    where = f"{queue}-shared-{pool}"
    calls = [
        core.step.apply_async((f"{run_id}-{n % 40}", history, 0.5), queue=where) for n in range(400)
    ]
    peak = 0
    deadline = time.monotonic() + RESULT_TIMEOUT
    while not all(call.ready() for call in calls) and time.monotonic() < deadline:
        peak = max(peak, shared_backends(pg_dsn, shared_worker.pid))
        time.sleep(0.1)  # a sampling period, not a synchronisation
    # Read from the stored results, not through get(): with hundreds of results at once
    # Celery's Redis result subscription can miss one and wait out its timeout
    # (celery/celery#4039) although the worker stored it.
    assert all(call.ready() for call in calls), "not every call ended in time"
    results = [call.result for call in calls]
    ran = [r for r in results if isinstance(r, dict) and r.get("ran")]
    skipped = [r for r in results if isinstance(r, dict) and r.get("skipped")]
    runs = read_history(pg_dsn, history)
    print(f"\n{pool} pool, shared: {len(ran)} ran, {len(skipped)} skipped, peak sessions {peak}")
    assert len(ran) + len(skipped) == 400 and ran and skipped
    assert {run.worker_pid for run in runs} == {shared_worker.pid}
    assert 1 <= peak <= 4
    assert overlaps(runs) == []
