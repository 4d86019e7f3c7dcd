"""A lost lock stops a body that computes without yielding, under every pool (real workers).

The body is a tight pure-Python loop: under gevent and eventlet it never lets the hub
run, so nothing that runs as a greenlet (a check, the interrupt thrown by the hub) can
reach it; under the threads pool it never waits in C. Its lock session's backend is
ended from outside, and the body must stop with LockLost within the detection bound
(``1.25 * pglock_check_interval``), as under prefork and solo. In the same green
worker, a healthy body is never interrupted, whether it runs while the loss is found
or is the one that keeps the hub from running.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
import redis
from celery import Celery

from pglock_celery import LockLost
from tests.apps import computing, core
from tests.support.services import wait_until
from tests.support.workers import Worker

#: The workers' check interval.
CHECK_INTERVAL = 0.5
#: The documented bound from the backend's end to the body's stop.
BOUND = 1.25 * CHECK_INTERVAL
#: What the body's stop may add to the bound on a loaded machine: a thread switch, the
#: signal, the stop time's write (a body that runs on is stopped 15 s late).
SLACK = 0.5
#: How long a body computes if nothing stops it.
BODY_SECONDS = 15.0
POOLS = {"prefork": 2, "solo": 1, "threads": 2, "gevent": 4, "eventlet": 4}
GREEN = ["gevent", "eventlet"]


@pytest.fixture(scope="module", params=list(POOLS))
def pool_worker(
    request: pytest.FixtureRequest, app: Celery, worker_env: dict[str, str], log_dir: Path
) -> Iterator[tuple[str, str]]:
    pool = request.param
    queue = f"{worker_env['PGLOCK_TEST_QUEUE']}-compute-{pool}"
    env = {**worker_env, "PGLOCK_TEST_QUEUE": queue, "PGLOCK_CHECK_INTERVAL": str(CHECK_INTERVAL)}
    worker = Worker(app, "tests.apps.computing", env, log_dir, pool=pool, concurrency=POOLS[pool])
    try:
        yield pool, queue
    finally:
        worker.stop()


@pytest.fixture
def marks(broker_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(broker_url)
    yield client
    client.close()


def backend_of(admin: psycopg.Connection, name: str, older_than: float = 0.0) -> int | None:
    """The backend of the session that holds ``name`` (its application_name ends with it),
    once it has been open ``older_than`` seconds (the server's clock)."""
    row = admin.execute(
        "SELECT pid FROM pg_stat_activity WHERE application_name LIKE %s"
        " AND clock_timestamp() - backend_start >= make_interval(secs => %s)",
        (f"%|{name}", older_than),
    ).fetchone()
    return row[0] if row else None


def stopped_at(marks: redis.Redis, key: str) -> float:
    value = wait_until(lambda: marks.get(key), 10, "the body to record its stop")
    assert isinstance(value, bytes)
    return float(value)


def test_a_lost_lock_stops_a_body_that_computes_without_yielding(
    pool_worker: tuple[str, str], admin: psycopg.Connection, marks: redis.Redis, run_id: str
) -> None:
    pool, queue = pool_worker
    tenant, key = f"{run_id}{pool[:2]}", f"stopped:{run_id}"
    call = computing.compute_under_lock.apply_async((tenant, BODY_SECONDS, key), queue=queue)
    # Past its first check: the loss comes at any moment of the interval, as it would.
    backend = wait_until(
        lambda: backend_of(admin, f"tenant:{tenant}", 2.3 * CHECK_INTERVAL),
        30,
        "the body to compute for two check intervals",
    )
    admin.execute("SELECT pg_terminate_backend(%s)", (backend,))
    ended = time.time()
    with pytest.raises(LockLost):
        call.get(timeout=BODY_SECONDS + 15, propagate=True)
    took = stopped_at(marks, key) - ended
    print(f"{pool}: the body stopped {took:.3f} s after its backend was ended")
    assert took < BOUND + SLACK, f"{pool}: the body ran on for {took:.2f} s"


@pytest.mark.parametrize("pool_worker", GREEN, indirect=True)
def test_a_healthy_body_beside_the_stopped_one_runs_to_its_end(
    pool_worker: tuple[str, str], admin: psycopg.Connection, marks: redis.Redis, run_id: str
) -> None:
    """The interrupt lands in the computing body only, not in a sleeping neighbour."""
    _, queue = pool_worker
    healthy = core.sleep_under_lock.apply_async((f"{run_id}ok", 4.0, 0.05), queue=queue)
    wait_until(lambda: backend_of(admin, f"tenant:{run_id}ok"), 30, "the healthy body to start")
    tenant, key = f"{run_id}lo", f"stopped:{run_id}"
    lost = computing.compute_under_lock.apply_async((tenant, BODY_SECONDS, key), queue=queue)
    backend = wait_until(lambda: backend_of(admin, f"tenant:{tenant}"), 30, "the body to start")
    admin.execute("SELECT pg_terminate_backend(%s)", (backend,))
    ended = time.time()
    with pytest.raises(LockLost):
        lost.get(timeout=BODY_SECONDS + 15, propagate=True)
    assert stopped_at(marks, key) - ended < BOUND + SLACK
    result = healthy.get(timeout=30, propagate=True)
    assert result["slept"] >= 4.0


@pytest.mark.parametrize("pool_worker", GREEN, indirect=True)
def test_a_lost_lock_never_stops_the_body_that_keeps_its_own_from_running(
    pool_worker: tuple[str, str], admin: psycopg.Connection, marks: redis.Redis, run_id: str
) -> None:
    """A body switched out (sleeping) loses its lock while a healthy one computes: the
    healthy one computes to its end, and the lost one gets LockLost as it runs again."""
    _, queue = pool_worker
    tenant = f"{run_id}lo"
    lost = core.sleep_under_lock.apply_async((tenant, 60.0, 0.05), queue=queue)
    backend = wait_until(lambda: backend_of(admin, f"tenant:{tenant}"), 30, "the body to start")
    key = f"stopped:{run_id}"
    healthy = computing.compute_under_lock.apply_async((f"{run_id}ok", 3.0, key), queue=queue)
    wait_until(lambda: backend_of(admin, f"tenant:{run_id}ok"), 30, "the healthy body to start")
    admin.execute("SELECT pg_terminate_backend(%s)", (backend,))
    result = healthy.get(timeout=30, propagate=True)
    assert result["computed"] >= 3.0
    with pytest.raises(LockLost):
        lost.get(timeout=30, propagate=True)


HELD_BACK_INSIDE_THE_LIBRARY = """
import sys, time
green, name, dsn = sys.argv[1:]
if green == "gevent":
    from gevent import monkey
    monkey.patch_all()
    import gevent
    spawn, join = gevent.spawn, lambda g: g.join()
else:
    import eventlet
    eventlet.monkey_patch()
    spawn, join = eventlet.spawn, lambda g: g.wait()
import psycopg
from pglock_celery import LockLost
from pglock_celery.config import PglockConfig
from pglock_celery.lock import AdvisoryLock
from pglock_celery.monitor import Body
from pglock_celery.shield import library_code
from pglock_celery.sources import registry

def run():
    body = Body("held-back", registry.monitor)
    lock = AdvisoryLock(
        name,
        config=PglockConfig(dsn=dsn, check_interval=0.5),
        on_lost=lambda hold, loss: body.interrupt(loss.detail),
    )
    assert lock.acquire()
    with psycopg.connect(dsn, autocommit=True) as admin:
        admin.execute("SELECT pg_terminate_backend(%s)", (lock.backend_pid,))
    body.start()
    left = None
    try:
        with library_code():  # the library's code, computing: the loss is found meanwhile
            until = time.monotonic() + 2.0
            while time.monotonic() < until:
                pass
        left = time.monotonic()
        while time.monotonic() < left + 10:
            pass
        print("ran on")
    except LockLost:
        where = "inside" if left is None else f"{time.monotonic() - left:.3f}"
        print(f"stopped {where}")
    finally:
        body.end()
        try:
            lock.release()
        except LockLost:
            pass

join(spawn(run))
"""


@pytest.mark.parametrize("green", GREEN)
def test_a_loss_found_while_a_green_body_computes_in_the_library_comes_as_it_leaves(
    green: str, pg_dsn: str, run_id: str
) -> None:
    """The native watch finds the loss while the body is inside the library's code: it
    is held back (never raised there), and raised within a pass once the body is out."""
    done = subprocess.run(
        [sys.executable, "-c", HELD_BACK_INSIDE_THE_LIBRARY, green, f"held:{run_id}", pg_dsn],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert done.returncode == 0, done.stderr
    outcome = done.stdout.strip().splitlines()[-1]
    assert outcome.startswith("stopped ") and outcome != "stopped inside", outcome
    after = float(outcome.split()[1])
    print(f"{green}: stopped {after:.3f} s after leaving the library's code")
    assert after < CHECK_INTERVAL / 4 + SLACK
