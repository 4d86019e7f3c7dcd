"""Adversarial probes (passing, kept as regression tests): a loss in every state of the session."""

from __future__ import annotations

import contextlib
import time

import psycopg
import pytest

from pglock_celery import LockLost
from pglock_celery.sources import registry
from tests.adversary_helpers import make_lock, run_bounded, terminate


@pytest.fixture(autouse=True)
def empty_cache() -> None:
    registry.close()


def _lost_within(lock, seconds: float) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + seconds
    while lock.lost_reason is None and time.monotonic() < deadline:
        time.sleep(0.05)
    return lock.lost_reason is not None


def test_a_session_killed_while_idle_is_found_lost_by_the_monitor(pg_dsn: str, run_id: str) -> None:
    """Probe: killed between statements, the monitor reports it; sleep() and release raise."""
    lock = make_lock(pg_dsn, f"adv:idle:{run_id}", check_interval=0.2)
    assert lock.acquire()
    terminate(pg_dsn, lock.backend_pid)  # type: ignore[union-attr]
    assert _lost_within(lock, 2)
    with pytest.raises(LockLost):
        lock.sleep(0.1)
    with pytest.raises(LockLost):
        lock.release()


def test_a_session_killed_inside_the_bodys_transaction_is_found_lost(
    pg_dsn: str, run_id: str
) -> None:
    """Probe: killed while idle in the body's transaction, the monitor reports it, no commit."""
    lock = make_lock(pg_dsn, f"adv:intx:{run_id}", check_interval=0.2)
    assert lock.acquire()
    conn = lock.connection
    conn.autocommit = False
    conn.execute("SELECT 1")
    terminate(pg_dsn, conn.info.backend_pid)
    assert _lost_within(lock, 2)
    with pytest.raises(psycopg.Error):
        conn.commit()
    with pytest.raises(LockLost):
        lock.release()


def test_a_session_killed_during_a_statement_fails_the_statement(pg_dsn: str, run_id: str) -> None:
    """Probe: killed while a statement runs, the statement fails and held() says so."""
    lock = make_lock(pg_dsn, f"adv:stmt:{run_id}", check_interval=0.2)
    assert lock.acquire()
    conn = lock.connection
    backend = conn.info.backend_pid
    _finished, _result = run_bounded(
        lambda: (time.sleep(0.3), terminate(pg_dsn, backend)), 0
    )  # kills it 0.3 s into the statement below
    with pytest.raises(psycopg.OperationalError):
        conn.execute("SELECT pg_sleep(3)")
    assert not lock.held()
    with pytest.raises(LockLost):
        lock.release()


def test_a_session_that_replaced_a_dead_cached_one_is_watched(pg_dsn: str, run_id: str) -> None:
    """Probe: the fresh session that replaced a dead cached one is monitored like any other."""
    warm = make_lock(pg_dsn, f"adv:warm:{run_id}")
    assert warm.acquire()
    dead = warm.backend_pid
    warm.release()
    terminate(pg_dsn, dead)
    time.sleep(0.2)
    lock = make_lock(pg_dsn, f"adv:repl:{run_id}", check_interval=0.2)
    assert lock.acquire()
    backend = lock.backend_pid
    assert backend != dead
    terminate(pg_dsn, backend)
    assert _lost_within(lock, 2)
    with contextlib.suppress(LockLost):
        lock.release()


def test_a_lock_unlocked_behind_the_holders_back_ends_the_session(pg_dsn: str, run_id: str) -> None:
    """Probe: the session alive without its lock is found and ended, so its writes fail."""
    lock = make_lock(pg_dsn, f"adv:unl:{run_id}", check_interval=0.2)
    assert lock.acquire()
    conn = lock.connection
    conn.execute("SELECT pg_advisory_unlock_all()")  # a reset of the session, say
    assert _lost_within(lock, 2)
    time.sleep(0.2)
    with pytest.raises(psycopg.Error):
        conn.execute("SELECT 1")
    with pytest.raises(LockLost):
        lock.release()
