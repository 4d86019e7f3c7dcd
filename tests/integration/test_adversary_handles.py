"""Adversarial: the holder's handle (lock.connection) against release, reuse and the monitor."""

from __future__ import annotations

import contextlib
import sys
import threading
import time

import psycopg
import pytest

from pglock_celery import LockLost
from pglock_celery.sources import registry
from tests.adversary_helpers import make_lock, run_bounded, taken_elsewhere, terminate


@pytest.fixture(autouse=True)
def empty_cache() -> None:
    registry.close()


def _finish(lock) -> None:  # type: ignore[no-untyped-def]
    with contextlib.suppress(LockLost):
        lock.release()


# --- closing the handle -------------------------------------------------------------


def test_closing_the_lock_connection_keeps_the_lock_held(pg_dsn: str, run_id: str) -> None:
    """psycopg's `with conn:` idiom on lock.connection must not free the lock mid-body (G1)."""
    lock = make_lock(pg_dsn, f"adv:close:{run_id}")
    assert lock.acquire()
    try:
        with lock.connection as conn:  # closes conn on exit, as psycopg documents
            conn.execute("SELECT 1")
        # The body goes on: nobody else may take the lock now.
        assert not taken_elsewhere(pg_dsn, lock.key), "another session took the lock mid-body"
    finally:
        _finish(lock)


# --- a handle obtained while release runs -------------------------------------------


def test_a_handle_fetched_concurrently_with_release_is_dead_after_release(
    pg_dsn: str, run_id: str
) -> None:
    """lock.connection racing release() (another thread of the body) never yields a live handle."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    survivors: list[str] = []
    try:
        for attempt in range(5000):
            lock = make_lock(pg_dsn, f"adv:race:{run_id}")
            assert lock.acquire()
            barrier = threading.Barrier(2)
            box: list[psycopg.Connection] = []  # type: ignore[type-arg]

            def fetch() -> None:
                barrier.wait()  # noqa: B023
                with contextlib.suppress(LockLost):
                    box.append(lock.connection)  # noqa: B023

            thread = threading.Thread(target=fetch)
            thread.start()
            barrier.wait()
            _finish(lock)
            thread.join()
            if not box:
                continue
            # Released: the next holder takes the very session from the cache.
            nxt = make_lock(pg_dsn, f"adv:race-next:{run_id}")
            assert nxt.acquire()
            try:
                row = box[0].execute("SELECT pg_backend_pid()").fetchone()
                survivors.append(
                    f"attempt {attempt}: the released handle ran a statement on backend "
                    f"{row[0] if row else None} while {nxt.label} held it"
                )
            except psycopg.Error:
                pass
            finally:
                _finish(nxt)
            if survivors:
                break
    finally:
        sys.setswitchinterval(old)
    assert not survivors, survivors[0]


# --- prepared statements: the holder's handle and the library share one session -------


def test_a_holders_repeated_query_works_on_a_reused_session(pg_dsn: str, run_id: str) -> None:
    """A reused session is like a fresh one: a query run 8 times (psycopg prepares it) works."""
    for i in range(6):  # six plain holds on the one cached session
        lock = make_lock(pg_dsn, f"adv:prep:{run_id}:{i}")
        assert lock.acquire()
        lock.release()
    assert registry.idle_count() == 1
    lock = make_lock(pg_dsn, f"adv:prep:{run_id}")
    assert lock.acquire()
    try:
        for i in range(8):
            lock.connection.execute("SELECT %s::int", (i,))
    finally:
        _finish(lock)


def test_a_long_body_can_repeat_a_query_after_the_monitor_ran(pg_dsn: str, run_id: str) -> None:
    """The monitor's checks must not break the holder's own prepared statements."""
    lock = make_lock(pg_dsn, f"adv:prep2:{run_id}", strategy="connect", check_interval=0.1)
    assert lock.acquire()
    try:
        time.sleep(1.5)  # a dozen loss checks on the session
        assert lock.lost_reason is None
        for i in range(8):
            lock.connection.execute("SELECT %s::int", (i,))
    finally:
        _finish(lock)


def test_a_body_repeating_a_query_gets_no_false_loss(pg_dsn: str, run_id: str) -> None:
    """A held lock whose holder prepared statements is not reported lost by the monitor."""
    lock = make_lock(pg_dsn, f"adv:prep3:{run_id}", strategy="connect", check_interval=0.1)
    assert lock.acquire()
    try:
        for i in range(8):
            lock.connection.execute("SELECT %s::int", (i,))
        time.sleep(1.5)
        assert taken_elsewhere(pg_dsn, lock.key) is False  # really still held
        assert lock.lost_reason is None, lock.lost_reason
    finally:
        _finish(lock)


# --- pipeline mode ------------------------------------------------------------------


def _unstick(pg_dsn: str, lock, backend: int) -> None:  # type: ignore[no-untyped-def]
    terminate(pg_dsn, backend)  # frees a thread stuck on the session
    time.sleep(0.3)
    _finish(lock)


def test_ensure_held_inside_a_pipeline_returns(pg_dsn: str, run_id: str) -> None:
    """lock.ensure_held() called inside `with lock.connection.pipeline()` answers, never hangs."""
    lock = make_lock(pg_dsn, f"adv:pipe:{run_id}")
    assert lock.acquire()
    conn = lock.connection
    backend = conn.info.backend_pid

    def body() -> str:
        with conn.pipeline():
            lock.ensure_held()
            conn.execute("SELECT 1")
        return "done"

    try:
        finished, result = run_bounded(body, 5)
        assert finished, "ensure_held() inside a pipeline hung for 5 s"
        assert result == "done", result
    finally:
        _unstick(pg_dsn, lock, backend)


def test_the_monitor_never_hangs_a_body_running_a_pipeline(pg_dsn: str, run_id: str) -> None:
    """A body batching writes in a pipeline for longer than the check interval finishes."""
    lock = make_lock(pg_dsn, f"adv:pipe2:{run_id}", check_interval=0.2)
    assert lock.acquire()
    conn = lock.connection
    backend = conn.info.backend_pid

    def body() -> str:
        with conn.pipeline() as pipeline:
            for i in range(10):
                conn.execute("SELECT %s::int", (i,))
                pipeline.sync()
                time.sleep(0.2)  # the work between two writes of the batch
        return "done"

    try:
        finished, result = run_bounded(body, 10)
        assert finished, "the body hung: the monitor's check is stuck in the holder's pipeline"
        assert result == "done", result
    finally:
        _unstick(pg_dsn, lock, backend)


# --- probes that pass: kept as regression tests ---------------------------------------


def test_a_cursor_made_during_the_hold_cannot_run_under_the_next_holder(
    pg_dsn: str, run_id: str
) -> None:
    """Probe: a cursor kept past release fails on the session the next holder reuses."""
    first = make_lock(pg_dsn, f"adv:cur:{run_id}")
    assert first.acquire()
    cursor = first.connection.cursor()
    first.release()
    nxt = make_lock(pg_dsn, f"adv:cur-next:{run_id}")
    assert nxt.acquire()
    try:
        assert registry.idle_count() == 0  # the next holder has the same session
        with pytest.raises(psycopg.Error):
            cursor.execute("SELECT 1")
        with pytest.raises(psycopg.Error):
            cursor.connection.commit()
    finally:
        _finish(nxt)


def test_a_release_from_another_thread_waits_for_the_running_statement(
    pg_dsn: str, run_id: str
) -> None:
    """Probe: release() while a body thread runs a statement: no hang, no lock left."""
    lock = make_lock(pg_dsn, f"adv:rel:{run_id}")
    assert lock.acquire()
    conn = lock.connection
    box: list[object] = []
    thread = threading.Thread(
        target=lambda: box.append(run_bounded(lambda: conn.execute("SELECT pg_sleep(1)"), 8))
    )
    thread.start()
    time.sleep(0.2)
    finished, _ = run_bounded(lock.release, 8)
    thread.join()
    assert finished
    assert taken_elsewhere(pg_dsn, lock.key)
