"""A lost lock stops its body: LockLost is raised inside it, under every pool (real workers).

The body sleeps and never touches its lock; its lock session's backend is ended from
outside. With the default ``pglock_on_lost = "interrupt"`` the call ends with LockLost
within the detection bound, long before its sleep would have. Under the threads pool
the exception comes at the thread's next bytecode, so that body sleeps in short
chunks (a long C call there is documented as a limit).
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from celery import Celery

from pglock_celery import LockLost
from pglock_celery.monitor import Body, Monitor
from tests.apps import core
from tests.support.services import wait_until
from tests.support.workers import Worker

#: The worker's check interval: a loss is found within about 1.25 of it.
CHECK_INTERVAL = 0.5
#: How long the body would sleep if nothing stopped it.
BODY_SECONDS = 60.0
POOLS = {
    "prefork": (BODY_SECONDS, 2),
    "solo": (BODY_SECONDS, 1),
    "threads": (0.05, 2),
    "gevent": (BODY_SECONDS, 4),
    "eventlet": (BODY_SECONDS, 4),
}


@pytest.fixture(scope="module", params=list(POOLS))
def pool_worker(
    request: pytest.FixtureRequest, app: Celery, worker_env: dict[str, str], log_dir: Path
) -> Iterator[tuple[str, str]]:
    pool = request.param
    queue = f"{worker_env['PGLOCK_TEST_QUEUE']}-stop-{pool}"
    env = {**worker_env, "PGLOCK_TEST_QUEUE": queue, "PGLOCK_CHECK_INTERVAL": str(CHECK_INTERVAL)}
    worker = Worker(app, "tests.apps.core", env, log_dir, pool=pool, concurrency=POOLS[pool][1])
    try:
        yield pool, queue
    finally:
        worker.stop()


def backend_of(admin: psycopg.Connection, name: str) -> int | None:
    """The backend of the session that holds ``name`` (its application_name ends with it)."""
    row = admin.execute(
        "SELECT pid FROM pg_stat_activity WHERE application_name LIKE %s",
        (f"%|{name}",),
    ).fetchone()
    return row[0] if row else None


def test_a_lost_lock_raises_lock_lost_inside_a_body_that_never_touches_it(
    pool_worker: tuple[str, str], admin: psycopg.Connection, run_id: str
) -> None:
    pool, queue = pool_worker
    tenant = f"{run_id}{pool[:2]}"  # short: application_name keeps 63 bytes
    chunk = POOLS[pool][0]
    call = core.sleep_under_lock.apply_async((tenant, BODY_SECONDS, chunk), queue=queue)
    backend = wait_until(lambda: backend_of(admin, f"tenant:{tenant}"), 30, "the body to start")
    admin.execute("SELECT pg_terminate_backend(%s)", (backend,))
    ended = time.monotonic()
    with pytest.raises(LockLost):
        call.get(timeout=30, propagate=True)
    assert time.monotonic() - ended < 5 * CHECK_INTERVAL + 3, f"{pool}: the body ran on"


def test_nothing_is_raised_in_a_body_that_has_returned() -> None:
    """interrupt() after the body's end neither raises anything nor reports it delivered."""
    monitor = Monitor()
    outcome: list[object] = []
    done = threading.Event()

    def run() -> None:
        body = Body("stop:returned", monitor)
        body.running = True
        body.end()
        outcome.append(body)
        done.set()
        try:
            time.sleep(0.3)  # an interrupt now would land here
            outcome.append("not interrupted")
        except LockLost:
            outcome.append("interrupted")

    thread = threading.Thread(target=run)
    thread.start()
    assert done.wait(5)
    body = outcome[0]
    assert isinstance(body, Body)
    assert body.interrupt("too late") is False
    thread.join(5)
    assert outcome[1] == "not interrupted"


def test_a_thread_body_is_interrupted_at_its_next_bytecode() -> None:
    monitor = Monitor()
    started = threading.Event()
    outcome: list[str] = []
    bodies: list[Body] = []

    def run() -> None:
        body = Body("stop:thread", monitor)
        bodies.append(body)
        body.running = True
        started.set()
        try:
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                time.sleep(0.01)
            outcome.append("ran on")
        except LockLost as exc:
            outcome.append(f"interrupted: {exc}")
        finally:
            body.end()

    thread = threading.Thread(target=run)
    thread.start()
    assert started.wait(5)
    asked = time.monotonic()
    assert bodies[0].interrupt("the session failed")
    thread.join(5)
    assert outcome and outcome[0].startswith("interrupted")
    assert time.monotonic() - asked < 1


AFTER_A_THREAD_INTERRUPT = """
import sys, threading, time
from pglock_celery import LockLost, try_lock
from pglock_celery.monitor import Body, Monitor

started, bodies = threading.Event(), []

def run():
    body = Body("stop:after", Monitor())
    bodies.append(body)
    body.running = True
    started.set()
    try:
        while True:
            time.sleep(0.01)
    except LockLost:
        pass
    finally:
        body.end()

thread = threading.Thread(target=run)
thread.start()
started.wait(5)
assert bodies[0].interrupt("the session failed")
thread.join(5)
sys.setprofile(lambda frame, event, arg: None)  # a profiler sees every bytecode's pace
with try_lock(sys.argv[1], dsn=sys.argv[2]) as held:
    assert held.acquired
sys.setprofile(None)
print("ran on")
"""


def test_the_process_runs_on_at_full_pace_after_a_thread_body_was_interrupted(
    pg_dsn: str, run_id: str
) -> None:
    """Nothing of an interrupt stays behind in the interpreter (taking back an asynchronous
    exception with NULL left CPython's pending flag set: a profiled lock then never ended)."""
    done = subprocess.run(
        [sys.executable, "-c", AFTER_A_THREAD_INTERRUPT, f"stop:{run_id}", pg_dsn],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().endswith("ran on")
