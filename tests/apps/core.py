"""The Celery app that integration tests run in real workers.

Configured from the environment the test sets: PGLOCK_TEST_BROKER (broker and
result backend), PGLOCK_TEST_QUEUE, and the pglock settings (PGLOCK_DSN, ...).
Every step records its run in a history table through the lock's own
connection, stamped with the server clock.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import psycopg
import redis
from celery import Celery
from celery.exceptions import Ignore

from pglock_celery import LockUnavailable, TenantLockedTask, current_lock

app = Celery("pglock_tests")
app.conf.update(
    broker_url=os.environ.get("PGLOCK_TEST_BROKER", "redis://127.0.0.1:6379/0"),
    result_backend=os.environ.get("PGLOCK_TEST_BROKER", "redis://127.0.0.1:6379/0"),
    task_default_queue=os.environ.get("PGLOCK_TEST_QUEUE", "pglock-tests"),
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
    result_expires=3600,
    # A short visibility timeout (the redelivery test) with sweeps every second.
    broker_transport_options={
        "visibility_timeout": float(os.environ.get("PGLOCK_TEST_VISIBILITY_TIMEOUT", "3600")),
        "unacked_restore_interval": 1,
        "unacked_restore_throttle": 1,
        # kombu's default of 10 Redis connections per channel runs out under a gevent
        # pool of hundreds acking late (redis-py then raises MaxConnectionsError and
        # the worker reconnects, losing acks): room for every green thread.
        "max_connections": 1000,
    },
)


# Under pglock_strategy = "shared" a lock session never runs a holder's SQL, so the
# history is written on a connection of this process's own, stamped with the lock
# session's backend: a new one per write (a server restart breaks none that outlives
# it), at most a few at once however many threads or greenlets the pool runs.
_history_slots = threading.BoundedSemaphore(8)


def _write(statement: str, params: tuple[Any, ...]) -> Any:
    lock = current_lock()
    assert lock is not None, "step body ran without a current lock"
    if lock.config.strategy != "shared":
        with lock.transaction() as conn:
            cursor = conn.execute(statement, params)
            return cursor.fetchone() if cursor.description else None
    with _history_slots, psycopg.connect(lock.config.require_dsn(), autocommit=True) as conn:
        cursor = conn.execute(statement, params)
        return cursor.fetchone() if cursor.description else None


def _record_start(table: str, attempt: int = 0) -> int:
    lock = current_lock()
    assert lock is not None, "step body ran without a current lock"
    row = _write(
        f"INSERT INTO {table} (lock_name, worker_pid, session_pid, attempt, started)"
        " VALUES (%s, %s, %s, %s, clock_timestamp()) RETURNING id",
        (lock.name, os.getpid(), lock.backend_pid, attempt),
    )
    assert row is not None
    return int(row[0])


def _record_end(table: str, run_id: int) -> None:
    _write(f"UPDATE {table} SET finished = clock_timestamp() WHERE id = %s", (run_id,))


def _run(table: str, seconds: float, attempt: int = 0) -> dict[str, Any]:
    run_id = _record_start(table, attempt)
    time.sleep(seconds)
    _record_end(table, run_id)
    return {"ran": True, "pid": os.getpid(), "run": run_id}


@app.task(base=TenantLockedTask)
def step(tenant_id: str, table: str, seconds: float = 0.0) -> dict[str, Any]:
    """Record a run of ``seconds`` under the tenant's lock."""
    return _run(table, seconds)


@app.task(base=TenantLockedTask, lock_mode="wait", lock_timeout=30)
def wait_step(tenant_id: str, table: str, seconds: float = 0.0) -> dict[str, Any]:
    return _run(table, seconds)


@app.task(base=TenantLockedTask, reject_on_worker_lost=False)
def hold(tenant_id: str, table: str, seconds: float) -> dict[str, Any]:
    """Like step, but a killed run is not redelivered: the test that kills it owns it."""
    return _run(table, seconds)


@app.task(base=TenantLockedTask, lock_mode="wait", lock_timeout=0.5)
def wait_briefly(tenant_id: str, table: str) -> dict[str, Any]:
    return _run(table, 0)


@app.task(base=TenantLockedTask, lock_mode="retry", lock_retry_countdown=0.2, max_retries=50)
def retry_step(tenant_id: str, table: str) -> dict[str, Any]:
    return _run(table, 0)


@app.task(base=TenantLockedTask, lock_mode="retry", lock_retry_countdown=0.1, max_retries=2)
def retry_briefly(tenant_id: str, table: str) -> dict[str, Any]:
    return _run(table, 0)


@app.task(base=TenantLockedTask, bind=True, max_retries=3)
def retry_self(self: TenantLockedTask, tenant_id: str, table: str) -> dict[str, Any]:
    """Retry once; the first attempt stays in its body until the retry has finished.

    That retry can only run if the first attempt gave up its lock when it
    asked to be retried.
    """
    attempt = self.request.retries
    run_id = _record_start(table, attempt)
    if attempt > 0:
        _record_end(table, run_id)
        return {"ran": True, "attempt": attempt}
    retry = self.retry(countdown=0, throw=False)
    with psycopg.connect(os.environ["PGLOCK_DSN"], autocommit=True) as conn:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            seen = conn.execute(
                f"SELECT count(*) FROM {table} WHERE attempt = 1 AND finished IS NOT NULL"
            ).fetchone()
            if seen and seen[0]:
                break
            time.sleep(0.02)
        # Leaving the body now: recorded through a connection of its own, the lock's
        # having been revoked when the retry released the lock.
        conn.execute(f"UPDATE {table} SET finished = clock_timestamp() WHERE id = %s", (run_id,))
    raise retry


@app.task(base=TenantLockedTask, reject_on_worker_lost=False, acks_late=False)
def sleep_under_lock(tenant_id: str, seconds: float, chunk: float) -> dict[str, Any]:
    """Sleep ``seconds`` under the lock, in sleeps of ``chunk`` seconds, touching nothing."""
    started = time.monotonic()
    while time.monotonic() - started < seconds:
        time.sleep(chunk)
    return {"slept": time.monotonic() - started, "pid": os.getpid()}


@app.task(base=TenantLockedTask)
def fail(tenant_id: str) -> None:
    raise ValueError(f"step for {tenant_id} failed on purpose")


@app.task(base=TenantLockedTask)
def ignore(tenant_id: str, table: str) -> None:
    _record_start(table)
    raise Ignore()


@app.task(base=TenantLockedTask, soft_time_limit=0.5)
def overrun(tenant_id: str) -> None:
    time.sleep(30)


@app.task(base=TenantLockedTask, bind=True, max_retries=1)
def retry_once(self: TenantLockedTask, tenant_id: str) -> str:
    if self.request.retries == 0:
        raise self.retry(countdown=0)
    return "retried"


def _marker() -> redis.Redis:
    return redis.Redis.from_url(app.conf.broker_url)


@app.task(base=TenantLockedTask)
def hold_until(tenant_id: str, table: str, marker: str) -> dict[str, Any]:
    """Record a run that holds its lock until the test sets ``marker`` (60 s at most)."""
    run_id = _record_start(table)
    lock = current_lock()
    assert lock is not None
    deadline = time.monotonic() + 60
    while not _marker().exists(marker) and time.monotonic() < deadline:
        lock.sleep(0.05)
    _record_end(table, run_id)
    return {"ran": True, "pid": os.getpid(), "run": run_id}


@app.task(base=TenantLockedTask)
def mark(tenant_id: str, marker: str) -> str:
    """Set a Redis key: proof that the body ran."""
    _marker().set(marker, "ran")
    return "ran"


class CountingRetries(TenantLockedTask):
    def on_retry(self, exc, task_id, args, kwargs, einfo):  # type: ignore[no-untyped-def]
        _marker().incr(f"retries:{task_id}")


@app.task(
    base=CountingRetries,
    autoretry_for=(LockUnavailable,),
    retry_kwargs={"countdown": 0.1},
    max_retries=2,
)
def mark_with_retries(tenant_id: str, marker: str) -> str:
    _marker().set(marker, "ran")
    return "ran"


@app.task(base=TenantLockedTask)
def chaos_step(tenant_id: str, table: str, seconds: float) -> dict[str, Any]:
    """A run with a non-atomic read-sleep-write counter: lost updates show overlaps."""
    lock = current_lock()
    assert lock is not None
    run_id = _record_start(table)
    read = _write(
        f"SELECT coalesce((SELECT n FROM {table}_counter WHERE lock_name = %s), 0)",
        (lock.name,),
    )
    assert read is not None
    lock.sleep(seconds)
    _write(
        f"INSERT INTO {table}_counter (lock_name, n) VALUES (%s, %s)"
        " ON CONFLICT (lock_name) DO UPDATE SET n = EXCLUDED.n",
        (lock.name, read[0] + 1),
    )
    _record_end(table, run_id)
    return {"ran": True, "pid": os.getpid(), "run": run_id}


@app.task(base=TenantLockedTask, time_limit=1)
def stuck(tenant_id: str, table: str) -> None:
    """Overruns its hard time limit: the pool kills the process mid-step."""
    _record_start(table)
    time.sleep(30)


@app.task
def collect(results: list[Any]) -> list[Any]:
    """A chord body: what its header's calls returned."""
    return results


class ReplacedAfterward(TenantLockedTask):
    """Publishes its replacement, then stays in its body until the replacement has a result
    (30 s at most): the replacement can only run if the lock was given up before it was sent."""

    def on_replace(self, sig):  # type: ignore[no-untyped-def]
        try:
            return super().on_replace(sig)
        except Ignore:
            # The replacement carries this call's task id: its result is the one awaited.
            replacement = self.AsyncResult(self.request.id)
            deadline = time.monotonic() + 30
            while not replacement.ready() and time.monotonic() < deadline:
                time.sleep(0.02)
            raise


@app.task(base=ReplacedAfterward, bind=True)
def replace_self(
    self: TenantLockedTask, tenant_id: str, table: str, stage: str = "first"
) -> dict[str, Any]:
    """Replace itself with its second stage, under the same lock."""
    if stage == "first":
        return self.replace(replace_self.si(tenant_id, table, "second"))
    return {**_run(table, 0), "stage": stage}


@app.task
def after(previous: Any, label: str = "after") -> dict[str, Any]:
    """A chain's next step: what the step before it returned."""
    return {label: previous}
