"""G7, handles die at release: a holder's connection, its cursors and its pgconn.

What a body does with ``lock.connection`` (closes it, keeps it or a cursor past release,
fetches it while another thread releases) never frees the lock early nor lets a
statement run on the session after release; handles.py's cooperative waits follow
what gevent patched.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time

import psycopg
import pytest

from pglock_celery import LockLost, handles
from pglock_celery.sources import registry
from tests.support.locks import finish, free_elsewhere, lock, run_bounded
from tests.support.services import scalar

pytestmark = pytest.mark.usefixtures("empty_cache")  # no idle session across tests


CHECK_INTERVAL = 0.2


# --- closing the handle ------------------------------------------------------------------


def test_closing_the_lock_connection_keeps_the_lock_held(pg_dsn: str, run_id: str) -> None:
    """psycopg's `with conn:` idiom on lock.connection must not free the lock mid-body (G1)."""
    holder = lock(pg_dsn, f"close:{run_id}")
    assert holder.acquire()
    try:
        with holder.connection as conn:  # closes conn on exit, as psycopg documents
            conn.execute("SELECT 1")
        # The body goes on: nobody else may take the lock now.
        assert not free_elsewhere(pg_dsn, holder.key), "another session took the lock mid-body"
    finally:
        finish(holder)


def test_a_closed_handle_is_dead_and_the_holder_gets_a_fresh_one(pg_dsn: str, run_id: str) -> None:
    with lock(pg_dsn, f"a:{run_id}") as held:
        with held.connection as first:
            closed_cursor = first.cursor()
        assert first.closed
        with pytest.raises(psycopg.OperationalError, match=CLOSED_HANDLE):
            closed_cursor.execute("SELECT 1")
        again = held.connection
        assert again is not first and again.execute("SELECT 1").fetchone() == (1,)
        cursor = again.cursor()
    with pytest.raises(psycopg.OperationalError, match=rf"^lock a:{run_id} {RELEASED}$"):
        cursor.execute("SELECT 1")


CLOSED_HANDLE = r"^this handle of the lock connection was closed$"
RELEASED = "was released: this connection is closed"


# --- a handle kept past release -----------------------------------------------------------


@pytest.mark.parametrize("strategy", ["reuse", "connect"])
def test_a_handle_kept_past_release_cannot_write(
    pg_dsn: str, run_id: str, table: str, strategy: str
) -> None:
    with lock(pg_dsn, f"a:{run_id}", strategy=strategy, check_interval=CHECK_INTERVAL) as first:
        kept = first.connection
        cursor = kept.cursor()
    with lock(pg_dsn, f"a:{run_id}", strategy=strategy, check_interval=CHECK_INTERVAL) as second:
        assert second.acquired
        for write in (
            lambda: kept.execute(f"INSERT INTO {table} VALUES (1)"),
            lambda: cursor.execute(f"INSERT INTO {table} VALUES (1)"),
            lambda: kept.cursor().execute(f"INSERT INTO {table} VALUES (1)"),
        ):
            with pytest.raises(psycopg.OperationalError):
                write()
        assert kept.closed
    assert scalar(pg_dsn, f"SELECT count(*) FROM {table}") == 0


def test_a_cursor_made_during_the_hold_cannot_run_under_the_next_holder(
    pg_dsn: str, run_id: str
) -> None:
    """A cursor kept past release fails on the session the next holder reuses."""
    first = lock(pg_dsn, f"cur:{run_id}")
    assert first.acquire()
    cursor = first.connection.cursor()
    first.release()
    nxt = lock(pg_dsn, f"cur-next:{run_id}")
    assert nxt.acquire()
    try:
        assert registry.idle_count() == 0  # the next holder has the same session
        with pytest.raises(psycopg.Error):
            cursor.execute("SELECT 1")
        with pytest.raises(psycopg.Error):
            cursor.connection.commit()
    finally:
        finish(nxt)


def test_a_handle_fetched_concurrently_with_release_is_dead_after_release(
    pg_dsn: str, run_id: str
) -> None:
    """lock.connection racing release() (another thread of the body) never yields a live handle."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    survivors: list[str] = []
    try:
        for attempt in range(5000):
            holder = lock(pg_dsn, f"race:{run_id}")
            assert holder.acquire()
            barrier = threading.Barrier(2)
            box: list[psycopg.Connection] = []  # type: ignore[type-arg]

            def fetch() -> None:
                barrier.wait()  # noqa: B023
                with contextlib.suppress(LockLost):
                    box.append(holder.connection)  # noqa: B023

            thread = threading.Thread(target=fetch)
            thread.start()
            barrier.wait()
            finish(holder)
            thread.join()
            if not box:
                continue
            # Released: the next holder takes the very session from the cache.
            nxt = lock(pg_dsn, f"race-next:{run_id}")
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
                finish(nxt)
            if survivors:
                break
    finally:
        sys.setswitchinterval(old)
    assert not survivors, survivors[0]


def test_a_release_from_another_thread_waits_for_the_running_statement(
    pg_dsn: str, run_id: str
) -> None:
    """release() from another thread while the body runs a statement: no hang, no lock left."""
    holder = lock(pg_dsn, f"rel:{run_id}")
    assert holder.acquire()
    conn = holder.connection
    box: list[object] = []
    thread = threading.Thread(
        target=lambda: box.append(run_bounded(lambda: conn.execute("SELECT pg_sleep(1)"), 8))
    )
    thread.start()
    time.sleep(0.2)
    finished, _ = run_bounded(holder.release, 8)
    thread.join()
    assert finished
    assert free_elsewhere(pg_dsn, holder.key)


# --- waits on the handle ------------------------------------------------------------------


@pytest.mark.parametrize("patched", [False, True])
def test_a_session_waits_cooperatively_only_when_select_is_patched(
    pg_dsn: str, run_id: str, monkeypatch: pytest.MonkeyPatch, patched: bool
) -> None:
    """gevent's own record of what it patched, set as gevent would (eventlet's import
    would make every later fork of this process warn)."""
    import gevent.monkey

    if patched:
        monkeypatch.setitem(gevent.monkey.saved, "select", {})
    assert (handles._green_select() == "gevent") is patched
    with lock(pg_dsn, f"a:{run_id}") as held:  # its statements wait the green way, or not
        assert held.acquired
        assert held.connection.execute("SELECT pg_sleep(0.05), 1").fetchone() == ("", 1)
