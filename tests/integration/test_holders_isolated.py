"""No holder's action (an error, a timeout, a statement) frees or weakens another holder's lock.

Under strategy ``shared`` holders share a session and run no SQL of their own on it
(test_shared_sessions.py shows the refusal); here, an SQL error in one shared holder's
try, and the fences of ``lock.transaction()`` and of kept handles under the strategies
that give a session of one's own.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable
from typing import Any

import psycopg
import pytest

from pglock_celery import LockLost, LockUnavailable
from tests.support.locks import DEDICATED, free_elsewhere, held_elsewhere, lock

pytestmark = pytest.mark.usefixtures("empty_cache")  # no idle session across tests


@pytest.fixture
def tiny_lock_table(server_of_its_own: Callable[..., str]) -> str:
    """A server of its own whose lock table a test may fill, with prepared transactions on."""
    return server_of_its_own("max_locks_per_transaction = 10", "max_prepared_transactions = 4")


def fill_lock_table(conn: psycopg.Connection) -> None:
    """Take advisory locks on ``conn`` until the server's lock table is full."""
    for start in range(0, 10_000_000, 500):
        try:
            conn.execute(
                "SELECT count(pg_try_advisory_lock(k)) FROM generate_series(%s::int8, %s) k",
                (start + 1, start + 500),
            )
        except psycopg.errors.OutOfMemory:
            return
    raise AssertionError("the lock table never filled")


def test_an_sql_error_in_one_holders_try_leaves_another_holders_shared_lock_held(
    tiny_lock_table: str, run_id: str
) -> None:
    dsn = tiny_lock_table
    first = lock(dsn, f"t:A:{run_id}", strategy="shared", shared_sessions=1)
    assert first.acquire()
    with psycopg.connect(dsn, autocommit=True) as hog:
        fill_lock_table(hog)
        second = lock(dsn, f"t:B:{run_id}", strategy="shared", shared_sessions=1)
        with pytest.raises(LockUnavailable, match="out of shared memory"):
            second.acquire()
        assert first.acquired and first.lost_reason is None
        hog.execute("SELECT pg_advisory_unlock_all()")
    assert not free_elsewhere(dsn, f"t:A:{run_id}")
    assert first.held()
    first.release()
    assert free_elsewhere(dsn, f"t:A:{run_id}")


@pytest.mark.parametrize("strategy", DEDICATED)
def test_unlocking_everything_inside_a_transaction_frees_no_lock_of_the_session(
    pg_dsn: str, run_id: str, strategy: str
) -> None:
    mine = lock(pg_dsn, f"t:A:{run_id}", strategy=strategy, shared_sessions=1)
    other = lock(pg_dsn, f"t:B:{run_id}", strategy=strategy, shared_sessions=1)
    assert mine.acquire() and other.acquire()
    try:
        with mine.transaction() as conn:
            conn.execute("SELECT pg_advisory_unlock_all()")
            assert not free_elsewhere(pg_dsn, f"t:A:{run_id}")
            assert not free_elsewhere(pg_dsn, f"t:B:{run_id}")
        assert not free_elsewhere(pg_dsn, f"t:A:{run_id}")
        assert not free_elsewhere(pg_dsn, f"t:B:{run_id}")
        assert mine.held() and other.held()
    finally:
        mine.release()
        other.release()
    assert free_elsewhere(pg_dsn, f"t:A:{run_id}") and free_elsewhere(pg_dsn, f"t:B:{run_id}")


@pytest.mark.parametrize("strategy", DEDICATED)
def test_a_write_under_the_lock_cannot_be_prepared_to_commit_after_release(
    tiny_lock_table: str, run_id: str, strategy: str
) -> None:
    dsn = tiny_lock_table
    with psycopg.connect(dsn, autocommit=True) as admin:
        admin.execute("CREATE TABLE IF NOT EXISTS steps (v int)")
    held = lock(dsn, f"t:{run_id}", strategy=strategy)
    assert held.acquire()
    with pytest.raises(psycopg.errors.FeatureNotSupported), held.transaction() as conn:
        conn.execute("INSERT INTO steps VALUES (1)")
        conn.execute(f"PREPARE TRANSACTION 'step-{run_id}'")
    held.release()
    with psycopg.connect(dsn, autocommit=True) as admin:
        assert admin.execute("SELECT count(*) FROM pg_prepared_xacts").fetchone() == (0,)
        assert admin.execute("SELECT count(*) FROM steps").fetchone() == (0,)


#: What a holder may keep of its handle that refers to the session's libpq connection.
KEPT: dict[str, Callable[[psycopg.Connection[Any]], Any]] = {
    "pgconn": lambda conn: conn.pgconn,
    "info.pgconn": lambda conn: conn.info.pgconn,
    "a cursor's pgconn": lambda conn: conn.cursor()._pgconn,
}


@pytest.mark.parametrize("kept", list(KEPT))
@pytest.mark.parametrize("strategy", DEDICATED)
def test_a_kept_libpq_connection_runs_nothing_on_the_next_holders_session(
    pg_dsn: str, run_id: str, strategy: str, kept: str
) -> None:
    """A holder that keeps its handle's libpq connection (however it got it) cannot free
    the next holder's lock: the session it refers to is never handed out again."""
    first = lock(pg_dsn, f"t:A:{run_id}", strategy=strategy)
    assert first.acquire()
    pgconn = KEPT[kept](first.connection)
    first.release()
    second = lock(pg_dsn, f"t:B:{run_id}", strategy=strategy)
    assert second.acquire()
    try:
        result = pgconn.exec_(b"SELECT pg_advisory_unlock_all()")
        assert result.status != psycopg.pq.ExecStatus.TUPLES_OK
    except psycopg.Error:
        pass  # the connection it kept is closed
    assert not free_elsewhere(pg_dsn, f"t:B:{run_id}")
    assert second.held()
    second.release()


@pytest.mark.parametrize("strategy", DEDICATED)
def test_a_weak_reference_kept_to_the_libpq_connection_keeps_the_session_from_reuse(
    pg_dsn: str, run_id: str, strategy: str
) -> None:
    """A weak reference counts as a reference: the next holder never gets that session."""
    first = lock(pg_dsn, f"t:A:{run_id}", strategy=strategy)
    assert first.acquire()
    kept = weakref.ref(first.connection.pgconn)
    first.release()
    second = lock(pg_dsn, f"t:B:{run_id}", strategy=strategy)
    assert second.acquire()
    try:
        pgconn = kept()
        if pgconn is not None:
            result = pgconn.exec_(b"SELECT pg_advisory_unlock_all()")
            assert result.status != psycopg.pq.ExecStatus.TUPLES_OK
    except psycopg.Error:
        pass  # the connection it refers to is closed
    assert not free_elsewhere(pg_dsn, f"t:B:{run_id}")
    assert second.held()
    second.release()


@pytest.mark.parametrize("strategy", DEDICATED)
def test_a_holder_that_prepares_a_statement_under_the_librarys_name_cannot_fake_its_check(
    pg_dsn: str, run_id: str, strategy: str
) -> None:
    """The library's check is never a statement a holder could have prepared in its place:
    a holder that frees its lock and plants its own pglock_check is found lost."""
    name = f"t:P:{run_id}"
    held = lock(pg_dsn, name, strategy=strategy, check_interval=60)
    assert held.acquire()
    assert held.held() and held.held()  # the library's check has run, and been prepared
    conn = held.connection
    with contextlib.suppress(psycopg.Error):
        conn.execute("DEALLOCATE pglock_check")
    conn.execute("PREPARE pglock_check (int8) AS SELECT false, true")
    conn.execute("SELECT pg_advisory_unlock_all()")
    other = held_elsewhere(pg_dsn, name)
    try:
        assert held.held() is False
    finally:
        other.close()
    with pytest.raises(LockLost):
        held.release()


def _use_a_cursor_and_return(held: Any) -> int:
    """A body that runs a statement through a cursor and keeps nothing when it returns."""
    with held.connection.cursor() as cursor:
        cursor.execute("SELECT 1")
    return int(held.connection.info.backend_pid)


def test_a_session_whose_handle_was_only_used_through_psycopg_serves_the_next_holder(
    pg_dsn: str, run_id: str
) -> None:
    """Statements, cursors and info read through psycopg leave nothing behind once the body
    returns: the session is reused."""
    with lock(pg_dsn, f"t:A:{run_id}") as first:
        backend = _use_a_cursor_and_return(first)
    with lock(pg_dsn, f"t:B:{run_id}") as second:
        assert second.connection.info.backend_pid == backend
