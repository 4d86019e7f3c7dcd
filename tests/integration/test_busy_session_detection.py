"""G7 completed: a loss is found whatever the session is doing, and a wait ends on a frozen server.

A session busy in the holder's pipeline, COPY or transaction cannot be asked without
waiting for the holder or disturbing what it does; it is judged from outside (its
socket, then the server's view: the same server, its backend, its key) within the
detection bound. A body inside a task is stopped by the loss (LockLost raised in it).
A wait for a lock with no timeout ends with LockUnavailable once the server stops
answering.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import psycopg
import pytest

from pglock_celery import LockLost, LockUnavailable, TenantLockedTask, current_lock
from pglock_celery.lock import AdvisoryLock
from pglock_celery.loss import LossKind
from tests.support.locks import DEDICATED, eager_app, held_elsewhere, lock, terminate
from tests.support.services import wait_until

pytestmark = pytest.mark.usefixtures("empty_cache")

#: The holders' check interval: a loss is found within about 1.25 of it, plus a probe.
CHECK_INTERVAL = 0.2
#: How long a loss may take to be found here (the bound, with room for a loaded machine).
FOUND_WITHIN = 5.0


def found_while_busy(held: AdvisoryLock, seconds: float = FOUND_WITHIN) -> bool:
    """Poll ``held.loss`` (no statement, no I/O) until the loss is found or time is up."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if held.loss is not None:
            return True
        time.sleep(0.02)
    return False


@contextlib.contextmanager
def busy_in_pipeline(conn: psycopg.Connection[Any]) -> Iterator[None]:
    with conn.pipeline():
        conn.execute("SELECT 1")  # sent, its result not read: the pipeline is open
        yield


@contextlib.contextmanager
def busy_in_transaction(conn: psycopg.Connection[Any]) -> Iterator[None]:
    with conn.transaction():
        conn.execute("SELECT 1")
        yield


@contextlib.contextmanager
def busy_in_copy(conn: psycopg.Connection[Any]) -> Iterator[None]:
    conn.execute("CREATE TEMP TABLE IF NOT EXISTS copied (v int)")
    with conn.cursor() as cursor, cursor.copy("COPY copied FROM STDIN") as copy:
        copy.write_row((1,))
        yield


BUSY: dict[str, Callable[[psycopg.Connection[Any]], contextlib.AbstractContextManager[None]]] = {
    "pipeline": busy_in_pipeline,
    "transaction": busy_in_transaction,
    "copy": busy_in_copy,
}


@pytest.mark.parametrize("busy", list(BUSY))
@pytest.mark.parametrize("strategy", DEDICATED)
def test_a_terminated_session_is_found_lost_while_the_holder_keeps_it_busy(
    pg_dsn: str, run_id: str, strategy: str, busy: str
) -> None:
    """The holder stays inside its pipeline, transaction or COPY; its backend is ended
    from outside: the loss is found (session ended) within the bound all the same."""
    held = lock(pg_dsn, f"b:{run_id}", strategy=strategy, check_interval=CHECK_INTERVAL)
    assert held.acquire()
    conn = held.connection
    with contextlib.suppress(psycopg.Error, LockLost), BUSY[busy](conn):
        assert terminate(pg_dsn, held.backend_pid or 0)
        assert found_while_busy(held), f"{busy}: the loss was not found while busy"
    assert held.loss is not None and held.loss.kind is LossKind.SESSION_ENDED
    with pytest.raises(LockLost):
        held.release()


@pytest.mark.parametrize("strategy", DEDICATED)
def test_a_lock_the_holder_freed_inside_its_pipeline_is_found_lost_before_the_pipeline_ends(
    pg_dsn: str, run_id: str, strategy: str
) -> None:
    """pg_advisory_unlock_all() sent in a pipeline left open: the server shows the key free,
    so the loss (lock gone) is found while the pipeline is still open."""
    held = lock(pg_dsn, f"p:{run_id}", strategy=strategy, check_interval=CHECK_INTERVAL)
    assert held.acquire()
    conn = held.connection
    with contextlib.suppress(psycopg.Error), conn.pipeline():
        conn.execute("SELECT pg_advisory_unlock_all()")
        conn.pgconn.flush()  # sent, its result unread
        assert found_while_busy(held), "the free key was not found while the pipeline was open"
    assert held.loss is not None and held.loss.kind is LossKind.LOCK_GONE
    with pytest.raises(LockLost):
        held.release()


def test_a_body_busy_in_its_pipeline_is_stopped_when_its_session_is_terminated(
    pg_dsn: str, run_id: str
) -> None:
    """Inside a task, a body that keeps its pipeline open and never asks its lock gets
    LockLost raised inside it once its backend is ended from outside."""
    app = eager_app(pg_dsn, check_interval=CHECK_INTERVAL)
    seen: dict[str, Any] = {}

    @app.task(base=TenantLockedTask, lock_name="pipe:{tenant}", shared=False)
    def step(tenant: str) -> None:
        held = current_lock()
        assert held is not None
        conn = held.connection
        with conn.pipeline():
            conn.execute("SELECT 1")
            assert terminate(pg_dsn, held.backend_pid or 0)
            seen["stopped_at"] = time.monotonic()
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:  # Python work, the lock never touched
                sum(range(1000))
            seen["ran_on"] = True

    result = step.apply((run_id,))
    assert "ran_on" not in seen, "the body ran on for 30 s under a lost lock"
    assert isinstance(result.result, LockLost), result.result


def freeze(dsn_data_dir: Path) -> list[psutil.Process]:
    """SIGSTOP a server's postmaster and every process of it: the whole server freezes."""
    pid = int((dsn_data_dir / "postmaster.pid").read_text().split()[0])
    postmaster = psutil.Process(pid)
    frozen = [postmaster, *postmaster.children(recursive=True)]
    for process in frozen:
        os.kill(process.pid, signal.SIGSTOP)
    return frozen


def test_a_wait_with_no_timeout_ends_when_the_server_stops_answering(
    server_of_its_own: Callable[..., str], tmp_path: Path, run_id: str
) -> None:
    """wait_lock without a timeout, on a name another session holds: the whole server
    freezes, and the wait ends with LockUnavailable within the bound (never for ever)."""
    dsn = server_of_its_own()
    name = f"w:{run_id}"
    other = held_elsewhere(dsn, name)
    waiting = lock(dsn, name, wait=True, timeout=None, check_interval=CHECK_INTERVAL)
    outcome: list[BaseException | bool] = []

    def wait() -> None:
        try:
            outcome.append(waiting.acquire())
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=wait, daemon=True)
    thread.start()
    with psycopg.connect(dsn, autocommit=True) as admin:
        wait_until(
            lambda: admin.execute(
                "SELECT 1 FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
                " AND application_name LIKE 'pglock%'"
            ).fetchone(),
            10,
            "the wait to be queued on the server",
        )
    frozen = freeze(tmp_path / "pg0" / "data")
    try:
        started = time.monotonic()
        thread.join(20)
        took = time.monotonic() - started
    finally:
        for process in frozen:
            with contextlib.suppress(OSError):
                os.kill(process.pid, signal.SIGCONT)
        other.close()
    assert not thread.is_alive(), "the wait went on against a frozen server"
    assert len(outcome) == 1 and isinstance(outcome[0], LockUnavailable), outcome
    print(f"\nfrozen server: the wait ended after {took:.1f} s")
