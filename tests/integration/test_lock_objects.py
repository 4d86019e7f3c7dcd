"""One AdvisoryLock object: polled until granted, acquired again, dropped without release.

A lock object may try again until it gets its lock; one dropped while held frees its
lock (by the monitor, a finalizer only hands the work on); one dropped after release
frees nobody else's lock, though another holder took its very session.
"""

from __future__ import annotations

import contextlib
import gc

import psycopg
import pytest

from pglock_celery import LockLost
from pglock_celery.sources import registry
from tests.support.locks import free_elsewhere, lock
from tests.support.services import wait_until

pytestmark = pytest.mark.usefixtures("empty_cache")  # no idle session across tests


CHECK_INTERVAL = 0.2


def test_a_polled_lock_object_dropped_later_leaves_another_holder_alone(
    pg_dsn: str, run_id: str
) -> None:
    """Polling acquire() until granted, releasing, then dropping the object frees nobody's lock."""
    blocker = psycopg.connect(pg_dsn, autocommit=True)
    try:
        poll = lock(pg_dsn, f"poll:{run_id}")
        blocker.execute("SELECT pg_advisory_lock(%s::int8)", (poll.key,))
        assert not poll.acquire()  # busy: the object keeps its session for the next poll
        blocker.execute("SELECT pg_advisory_unlock(%s::int8)", (poll.key,))
        assert poll.acquire()  # the documented second try
        poll.release()  # clean: the session goes back to the cache
        other = lock(pg_dsn, f"other:{run_id}")
        assert other.acquire()  # checks out that very session
        try:
            del poll  # the polling loop moves on to its next tenant
            gc.collect()
            assert other.held(), f"dropping a released object ended {other.label}'s hold"
            assert not free_elsewhere(pg_dsn, other.key)
        finally:
            with contextlib.suppress(LockLost):
                other.release()
    finally:
        blocker.close()


def test_one_lock_object_may_poll_until_it_gets_the_lock(pg_dsn: str, run_id: str) -> None:
    poller = lock(pg_dsn, f"a:{run_id}", check_interval=CHECK_INTERVAL)
    with lock(pg_dsn, f"a:{run_id}", check_interval=CHECK_INTERVAL) as holder:
        assert holder.acquired
        assert not poller.acquire()
        assert not poller.acquire()
    assert poller.acquire()
    with pytest.raises(RuntimeError, match="already held"):
        poller.acquire()
    poller.release()  # its unlock may not be waited for: free once the server reads it
    wait_until(lambda: free_elsewhere(pg_dsn, f"a:{run_id}"), 5, "the released lock to be free")


def test_a_lock_dropped_without_release_is_freed(pg_dsn: str, run_id: str) -> None:
    """An acquired object that is dropped (refcount, then in a cycle) frees its lock."""
    holder = lock(pg_dsn, f"drop:{run_id}")
    key = holder.key
    assert holder.acquire()
    conn = holder.connection
    del holder
    # Freed by the monitor thread (a finalizer only hands the work on), within a tick.
    wait_until(lambda: free_elsewhere(pg_dsn, key), 2, "the dropped lock to be freed")
    with pytest.raises(psycopg.Error):
        conn.execute("SELECT 1")

    cyclic = lock(pg_dsn, f"drop2:{run_id}")
    assert cyclic.acquire()
    cyclic.self_ref = cyclic  # type: ignore[attr-defined]
    key = cyclic.key
    del cyclic
    gc.collect()
    wait_until(lambda: free_elsewhere(pg_dsn, key), 2, "the dropped lock to be freed")
    assert registry.idle_count() == 0


def test_a_held_lock_dropped_without_release_frees_its_lock(pg_dsn: str, run_id: str) -> None:
    held = lock(pg_dsn, f"a:{run_id}", check_interval=CHECK_INTERVAL)
    assert held.acquire()
    held.sleep(0.5)  # past one check interval: its monitor is running
    assert not free_elsewhere(pg_dsn, f"a:{run_id}")
    del held
    gc.collect()
    wait_until(lambda: free_elsewhere(pg_dsn, f"a:{run_id}"), 2, "the dropped lock to go")
