"""TenantLockedTask in real `celery worker` processes on real Redis and Postgres."""

from __future__ import annotations

import os
import random
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import psycopg
import pytest
from celery import Celery, chain, chord
from celery.exceptions import TaskRevokedError, WorkerLostError

from pglock_celery import LockTimeout, lock_key, try_lock
from pglock_celery.keys import key_to_lock_fields
from tests.apps import core
from tests.support.history import overlaps, read_history
from tests.support.locks import free_elsewhere
from tests.support.services import wait_until
from tests.support.workers import Worker

RESULT_TIMEOUT = 60
#: The strategy the workers (and this process) run under, as the Makefile sets it.
STRATEGY = os.environ.get("PGLOCK_STRATEGY", "reuse")


def is_skip(result: object, lock: str) -> bool:
    return isinstance(result, dict) and result.get("skipped") is True and result["lock"] == lock


def test_two_prefork_workers_never_overlap_on_a_tenant(
    workers: list[Worker], history: str, pg_dsn: str, run_id: str
) -> None:
    """200 calls over 10 tenants with 5-50 ms bodies: every call ran or skipped, none overlap."""
    rng = random.Random(run_id)
    tenants = [f"{run_id}-{n}" for n in range(10)]
    order = tenants * 20
    rng.shuffle(order)
    calls = [(t, core.step.delay(t, history, rng.uniform(0.005, 0.05))) for t in order]
    results = [(tenant, call.get(timeout=RESULT_TIMEOUT)) for tenant, call in calls]

    ran = [result for _, result in results if isinstance(result, dict) and result.get("ran")]
    skipped = [(t, r) for t, r in results if is_skip(r, f"tenant:{t}")]
    runs = read_history(pg_dsn, history)
    print(f"\n{len(calls)} calls: {len(ran)} ran, {len(skipped)} skipped, {len(runs)} history rows")
    assert len(ran) + len(skipped) == len(calls) == 200
    assert len(runs) == len(ran)
    assert all(run.finished is not None for run in runs)
    pids = {run.worker_pid for run in runs}
    assert all(pids & set(worker.children()) for worker in workers), "a worker never ran a step"
    assert skipped, "no call ever found its tenant locked: the test could not have failed"
    assert overlaps(runs) == []


def waiting_sessions(dsn: str, key: int) -> int:
    """Sessions of this database queued in pg_locks for ``key``, not granted."""
    with psycopg.connect(dsn) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
            " AND classid = %s::int8::oid AND objid = %s::int8::oid"
            " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())",
            key_to_lock_fields(key),
        ).fetchone()
    return int(row[0]) if row else 0


#: G2's figure is a few milliseconds: this bound catches a tenfold regression.
KILL_TO_FREE_BOUND = 0.1


def test_sigkill_of_the_holding_child_frees_the_lock_within_100_ms(
    workers: list[Worker], history: str, pg_dsn: str, run_id: str
) -> None:
    """G2: the lock is free as soon as Postgres sees the killed holder's socket close."""
    tenant = f"{run_id}-killed"
    key = lock_key(f"tenant:{tenant}")
    call = core.hold.delay(tenant, history, 30)  # a killed run is not redelivered
    run = wait_until(lambda: read_history(pg_dsn, history), 30, "the step to start")[0]
    with psycopg.connect(pg_dsn, autocommit=True) as probe:
        assert not free_elsewhere(probe, key), "the step does not hold its lock: nothing to free"
        os.kill(run.worker_pid, signal.SIGKILL)
        killed_at = time.monotonic()
        while not free_elsewhere(probe, key):
            assert time.monotonic() - killed_at < 5, "the lock outlived its killed holder by 5 s"
        freed_after = time.monotonic() - killed_at
    print(f"\nSIGKILL of pid {run.worker_pid} -> lock free after {freed_after * 1000:.1f} ms")
    assert freed_after < KILL_TO_FREE_BOUND, f"freed after {freed_after * 1000:.0f} ms"
    with pytest.raises(WorkerLostError):
        call.get(timeout=RESULT_TIMEOUT)
    assert len(read_history(pg_dsn, history)) == 1


def test_wait_mode_makes_the_second_call_wait_then_run(
    workers: list[Worker], history: str, pg_dsn: str, run_id: str
) -> None:
    """The second call queues in Postgres while the first holds, then runs after it."""
    tenant = f"{run_id}-serial"
    key = lock_key(f"tenant:{tenant}")
    first = core.wait_step.delay(tenant, history, 1.5)
    wait_until(lambda: read_history(pg_dsn, history), 30, "the first call to start")
    second = core.wait_step.delay(tenant, history, 0)
    wait_until(lambda: waiting_sessions(pg_dsn, key) == 1, 20, "the second call to wait")
    assert len(read_history(pg_dsn, history)) == 1, "the second call ran while the first held"
    assert first.get(timeout=RESULT_TIMEOUT)["ran"] and second.get(timeout=RESULT_TIMEOUT)["ran"]
    earlier, later = sorted(read_history(pg_dsn, history), key=lambda run: run.started)
    assert earlier.worker_pid != later.worker_pid  # two processes: the second one waited
    assert earlier.finished is not None and later.started >= earlier.finished


def test_wait_mode_raises_lock_timeout_after_lock_timeout(
    workers: list[Worker], history: str, pg_dsn: str, run_id: str
) -> None:
    tenant = f"{run_id}-busy"
    with try_lock(f"tenant:{tenant}", dsn=pg_dsn) as held:
        assert held.acquired
        call = core.wait_briefly.delay(tenant, history)
        with pytest.raises(LockTimeout, match=f"tenant:{tenant}"):
            call.get(timeout=RESULT_TIMEOUT)
    assert read_history(pg_dsn, history) == []


def test_retry_mode_retries_while_held_and_runs_once_free(
    workers: list[Worker], app: Celery, history: str, pg_dsn: str, run_id: str
) -> None:
    tenant = f"{run_id}-retry"
    with try_lock(f"tenant:{tenant}", dsn=pg_dsn) as held:
        assert held.acquired
        call = core.retry_step.delay(tenant, history)
        wait_until(lambda: call.state == "RETRY", 30, "the call to be retried")
    result = call.get(timeout=RESULT_TIMEOUT)
    assert result["ran"] is True
    assert len(read_history(pg_dsn, history)) == 1


def test_retry_mode_fails_with_lock_timeout_when_its_retries_run_out(
    workers: list[Worker], history: str, pg_dsn: str, run_id: str
) -> None:
    tenant = f"{run_id}-retries"
    with try_lock(f"tenant:{tenant}", dsn=pg_dsn) as held:
        assert held.acquired
        call = core.retry_briefly.delay(tenant, history)
        with pytest.raises(LockTimeout, match=f"tenant:{tenant} was still held after 2 retries"):
            call.get(timeout=RESULT_TIMEOUT)
    assert read_history(pg_dsn, history) == []


def test_a_tasks_own_retry_is_not_blocked_by_its_own_lock(
    workers: list[Worker], history: str, pg_dsn: str, run_id: str
) -> None:
    """The retry runs start to end while the first attempt is still in its body."""
    tenant = f"{run_id}-self"
    core.retry_self.delay(tenant, history)
    query = f"SELECT attempt, started, finished FROM {history} ORDER BY attempt"
    with psycopg.connect(pg_dsn, autocommit=True) as conn:

        def first_left() -> list[tuple[Any, ...]] | None:
            rows = conn.execute(query).fetchall()
            return rows if any(row[0] == 0 and row[2] is not None for row in rows) else None

        # The first attempt leaves its body once the retry finished, or after 10 s.
        rows = wait_until(first_left, 30, "the first attempt to leave its body")
    assert [row[0] for row in rows] == [0, 1], f"the retry never ran: {rows}"
    (_, first_started, first_left), (_, retry_started, retry_finished) = rows
    assert retry_finished is not None
    assert first_started < retry_started and retry_finished <= first_left


def lock_sessions_of(dsn: str, name: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name LIKE %s",
            (f"pglock|%|{name}",),
        ).fetchone()
    return int(row[0]) if row else -1


def assert_released(dsn: str, name: str) -> None:
    wait_until(lambda: lock_sessions_of(dsn, name) == 0, 5, f"sessions of {name} to close")
    assert free_elsewhere(dsn, name)


def test_lock_is_released_on_success_exception_ignore_retry_and_soft_limit(
    workers: list[Worker], history: str, pg_dsn: str, run_id: str
) -> None:
    from celery.exceptions import SoftTimeLimitExceeded

    tenant = f"{run_id}-paths"
    name = f"tenant:{tenant}"

    assert core.step.delay(tenant, history).get(timeout=RESULT_TIMEOUT)["ran"]
    assert_released(pg_dsn, name)

    with pytest.raises(ValueError, match="on purpose"):
        core.fail.delay(tenant).get(timeout=RESULT_TIMEOUT)
    assert_released(pg_dsn, name)

    core.ignore.delay(tenant, history)  # Ignore leaves no result: its history row shows it ran
    wait_until(lambda: read_history(pg_dsn, history)[1:], 30, "the ignored call to run")
    assert_released(pg_dsn, name)

    assert core.retry_once.delay(tenant).get(timeout=RESULT_TIMEOUT) == "retried"
    assert_released(pg_dsn, name)

    with pytest.raises(SoftTimeLimitExceeded):
        core.overrun.delay(tenant).get(timeout=RESULT_TIMEOUT)
    assert_released(pg_dsn, name)


def test_revoke_with_terminate_frees_the_lock_and_the_step_never_runs_again(
    workers: list[Worker], history: str, pg_dsn: str, run_id: str
) -> None:
    tenant = f"{run_id}-revoked"
    name = f"tenant:{tenant}"
    call = core.step.delay(tenant, history, 30)
    run = wait_until(lambda: read_history(pg_dsn, history), 30, "the step to start")[0]
    assert not free_elsewhere(pg_dsn, name)
    call.revoke(terminate=True)
    revoked_at = time.monotonic()
    wait_until(lambda: free_elsewhere(pg_dsn, name), 10, "the revoked step's lock to go")
    print(f"\nrevoke(terminate=True): lock free after {time.monotonic() - revoked_at:.2f} s")
    with pytest.raises(TaskRevokedError):
        call.get(timeout=RESULT_TIMEOUT)
    wait_until(lambda: not psutil.pid_exists(run.worker_pid), 10, "the terminated process to end")
    time.sleep(1)  # a redelivered copy would have started by now
    assert len(read_history(pg_dsn, history)) == 1


def test_a_skip_releases_its_session(
    workers: list[Worker], history: str, pg_dsn: str, run_id: str
) -> None:
    tenant = f"{run_id}-skip"
    name = f"tenant:{tenant}"
    with try_lock(name, dsn=pg_dsn) as held:
        assert held.acquired
        result = core.step.delay(tenant, history).get(timeout=RESULT_TIMEOUT)
        assert is_skip(result, name)
        assert result["holder"]["backend_pid"] == held.backend_pid
        if STRATEGY != "shared":  # a shared session's holder is found by key (pg_locks)
            assert result["holder"]["worker_pid"] == os.getpid()
        # Only the test's own session is left: the skipped call closed its one.
        own = 0 if STRATEGY == "shared" else 1  # a shared session is not named after it
        wait_until(lambda: lock_sessions_of(pg_dsn, name) == own, 5, "the skip's session to close")
    assert_released(pg_dsn, name)
    assert read_history(pg_dsn, history) == []


@pytest.fixture(scope="module", params=[("threads", 4), ("gevent", 8)], ids=["threads", "gevent"])
def pool_worker(
    request: pytest.FixtureRequest, app: Celery, worker_env: dict[str, str], log_dir: Path
) -> Iterator[Worker]:
    """One worker whose pool runs several calls in one process, on a queue of its own."""
    pool, concurrency = request.param
    env = {**worker_env, "PGLOCK_TEST_QUEUE": f"{worker_env['PGLOCK_TEST_QUEUE']}-{pool}"}
    worker = Worker(app, "tests.apps.core", env, log_dir, pool=pool, concurrency=concurrency)
    yield worker
    worker.stop()


def test_calls_in_one_process_never_share_a_tenants_lock(
    pool_worker: Worker, queue: str, history: str, pg_dsn: str, run_id: str
) -> None:
    """Session locks are re-entrant: threads or greenlets of one process must not both get in."""
    pool = pool_worker.pool
    tenant = f"{run_id}-{pool}"
    calls = [
        core.step.apply_async((tenant, history, 0.02), queue=f"{queue}-{pool}") for _ in range(40)
    ]
    results = [call.get(timeout=RESULT_TIMEOUT) for call in calls]
    runs = read_history(pg_dsn, history)
    ran = [r for r in results if isinstance(r, dict) and r.get("ran")]
    skipped = [r for r in results if is_skip(r, f"tenant:{tenant}")]
    print(f"\n{pool} pool: {len(ran)} ran, {len(skipped)} skipped")
    assert len(ran) + len(skipped) == 40
    assert {run.worker_pid for run in runs} == {pool_worker.pid}
    assert skipped, "no two calls ever met on the tenant: the test could not have failed"
    assert overlaps(runs) == []


@pytest.fixture(scope="module")
def eventlet_worker(app: Celery, worker_env: dict[str, str], log_dir: Path) -> Iterator[Worker]:
    """An eventlet worker (4 green threads in one process) on a queue of its own."""
    env = {**worker_env, "PGLOCK_TEST_QUEUE": f"{worker_env['PGLOCK_TEST_QUEUE']}-eventlet"}
    worker = Worker(app, "tests.apps.core", env, log_dir, pool="eventlet", concurrency=4)
    yield worker
    worker.stop()


def test_a_waiting_call_under_eventlet_lets_the_holder_finish(
    eventlet_worker: Worker, queue: str, history: str, pg_dsn: str, run_id: str
) -> None:
    """A wait-mode call must yield to the hub: the holder, in the same process, finishes."""
    tenant, where = f"{run_id}-eventlet", f"{queue}-eventlet"
    holder = core.step.apply_async((tenant, history, 1.0), queue=where)
    wait_until(lambda: len(read_history(pg_dsn, history)) == 1, 20, "the holder to start")
    waiter = core.wait_step.apply_async((tenant, history, 0.0), queue=where)
    assert holder.get(timeout=RESULT_TIMEOUT)["ran"]
    assert waiter.get(timeout=RESULT_TIMEOUT)["ran"]
    first, second = read_history(pg_dsn, history)
    assert first.worker_pid == second.worker_pid == eventlet_worker.pid
    assert second.started >= first.finished  # type: ignore[operator]
    started = time.monotonic()
    eventlet_worker.stop()
    assert eventlet_worker.process.returncode == 0, "the worker did not end on SIGTERM"
    print(f"\neventlet worker stopped {time.monotonic() - started:.1f} s after SIGTERM")


def test_a_skip_ends_its_chain_and_a_chord_body_sees_the_skip(
    workers: list[Worker], history: str, run_id: str, pg_dsn: str
) -> None:
    tenant, free = f"{run_id}-canvas", f"{run_id}-free"
    marker = f"chain-{run_id}"
    with try_lock(f"tenant:{tenant}", dsn=pg_dsn) as held:
        assert held.acquired
        cut = chain(core.step.s(tenant, history), core.mark.si(free, marker)).apply_async()
        assert cut.parent is not None and is_skip(
            cut.parent.get(timeout=RESULT_TIMEOUT), f"tenant:{tenant}"
        )
        # The chain's next message is sent before a step's result is stored: none was.
        assert not cut.parent.children
        both = chord(
            [core.step.s(tenant, history), core.step.s(free, history)], core.collect.s()
        ).apply_async()
        results = both.get(timeout=RESULT_TIMEOUT)
    assert is_skip(results[0], f"tenant:{tenant}") and results[1]["ran"]
    whole = chain(core.step.s(tenant, history), core.mark.si(free, marker)).apply_async()
    assert whole.get(timeout=RESULT_TIMEOUT) == "ran"
    assert whole.parent is not None and whole.parent.children
