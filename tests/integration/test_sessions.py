"""The reuse strategy: idle lock-only sessions, one holder at a time, closed on any doubt."""

from __future__ import annotations

import os
import select

import psycopg
import pytest

from pglock_celery import LockLost, handles, lock_key, try_lock
from pglock_celery.config import PglockConfig
from pglock_celery.lock import AdvisoryLock
from pglock_celery.sources import registry
from tests.helpers.services import wait_until


@pytest.fixture(autouse=True)
def empty_cache() -> None:
    registry.close()


def lock(dsn: str, name: str, strategy: str = "reuse") -> AdvisoryLock:
    return AdvisoryLock(name, config=PglockConfig(dsn=dsn, strategy=strategy))


def test_a_clean_release_returns_the_session_for_the_next_lock(pg_dsn: str, run_id: str) -> None:
    with lock(pg_dsn, f"a:{run_id}") as first:
        backend = first.connection.info.backend_pid
    assert registry.idle_count() == 1
    with lock(pg_dsn, f"b:{run_id}") as second:
        assert second.connection.info.backend_pid == backend
        name = second.connection.execute("SHOW application_name").fetchone()
        assert name is not None and name[0].endswith(f"|b:{run_id}")
    with psycopg.connect(pg_dsn) as conn:
        name = conn.execute(
            "SELECT application_name FROM pg_stat_activity WHERE pid = %s", (backend,)
        ).fetchone()
        held = conn.execute(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = %s", (backend,)
        ).fetchone()
    assert name == (f"pglock-idle|{os.getpid()}",)  # back in the cache, under its idle name
    assert held == (0,)


def test_the_connect_strategy_never_keeps_a_session(pg_dsn: str, run_id: str) -> None:
    with lock(pg_dsn, f"a:{run_id}", strategy="connect"):
        pass
    assert registry.idle_count() == 0


def test_two_holders_in_one_process_never_share_a_session(pg_dsn: str, run_id: str) -> None:
    with lock(pg_dsn, f"a:{run_id}") as first, lock(pg_dsn, f"a:{run_id}") as second:
        assert first.acquired and not second.acquired
        assert first.connection.info.backend_pid != second.backend_pid


def test_a_failed_body_closes_its_session(pg_dsn: str, run_id: str) -> None:
    with pytest.raises(ZeroDivisionError), lock(pg_dsn, f"a:{run_id}"):
        1 / 0  # noqa: B018
    assert registry.idle_count() == 0


def test_an_open_transaction_closes_the_session(pg_dsn: str, run_id: str) -> None:
    with lock(pg_dsn, f"a:{run_id}") as held:
        held.connection.execute("BEGIN")
    assert registry.idle_count() == 0


def test_other_advisory_locks_of_the_body_do_not_survive_in_the_cache(
    pg_dsn: str, run_id: str
) -> None:
    stray = lock_key(f"stray:{run_id}")
    with lock(pg_dsn, f"a:{run_id}") as held:
        held.connection.execute("SELECT pg_advisory_lock(%s)", (stray,))
    assert registry.idle_count() == 1
    with try_lock(stray, dsn=pg_dsn) as other:
        assert other.acquired


def test_a_cached_session_that_died_is_replaced_before_locking(pg_dsn: str, run_id: str) -> None:
    with lock(pg_dsn, f"a:{run_id}") as first:
        backend = first.connection.info.backend_pid
    with psycopg.connect(pg_dsn, autocommit=True) as admin:
        admin.execute("SELECT pg_terminate_backend(%s)", (backend,))
    with lock(pg_dsn, f"a:{run_id}") as second:
        assert second.acquired
        assert second.connection.info.backend_pid != backend


def test_a_lost_lock_is_reported_and_its_session_is_not_kept(pg_dsn: str, run_id: str) -> None:
    with pytest.raises(LockLost), lock(pg_dsn, f"a:{run_id}") as held:
        held.connection.execute("SELECT pg_advisory_unlock_all()")
    assert registry.idle_count() == 0


def test_a_forked_child_does_not_use_its_parents_sessions(pg_dsn: str, run_id: str) -> None:
    with lock(pg_dsn, f"a:{run_id}") as first:
        backend = first.connection.info.backend_pid
    assert registry.idle_count() == 1
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: reports what it sees, then leaves without cleanup
        os.close(read)
        os.write(write, str(registry.idle_count()).encode())
        os._exit(0)
    os.close(write)
    seen = os.read(read, 16).decode()
    os.close(read)
    os.waitpid(pid, 0)
    assert seen == "0"
    # The parent's very session survived the child's exit (not a replacement).
    with lock(pg_dsn, f"b:{run_id}") as again:
        assert again.held()
        assert again.connection.info.backend_pid == backend


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


def test_what_a_forked_child_does_with_its_parents_sessions(pg_dsn: str, run_id: str) -> None:
    """The child's hook, run here as a child runs it: copies closed, handles dead, none kept.

    This process owns the sockets alone, so closing them frees the lock on the server:
    proof that the hook closed them (in a real child, the parent's copies keep them open).
    """
    with lock(pg_dsn, f"warm:{run_id}"):
        pass
    held = lock(pg_dsn, f"a:{run_id}")
    assert held.acquire()
    cursor = held.connection.cursor()
    registry._after_fork_in_child()
    assert registry.idle_count() == 0 and registry.shared_count() == 0
    with pytest.raises(
        psycopg.OperationalError, match=r"^this lock connection belongs to the parent process$"
    ):
        cursor.execute("SELECT 1")
    with psycopg.connect(pg_dsn, autocommit=True) as other:
        wait_until(
            lambda: (
                other.execute(
                    "SELECT pg_try_advisory_lock(%s)", (lock_key(f"a:{run_id}"),)
                ).fetchone()
                == (True,)
            ),
            5,
            "the server to see the closed socket",
        )
    with pytest.raises(LockLost):
        held.release()


def test_alive_reads_the_socket_without_taking_what_libpq_is_owed(pg_dsn: str, run_id: str) -> None:
    """A notification waiting on the socket is life, and psycopg still gets it after."""
    with lock(pg_dsn, f"a:{run_id}") as held:
        session = held._hold.session
        assert session is not None and session.alive()  # nothing arrived: alive
        conn = held.connection
        conn.execute(f"LISTEN ch_{run_id}")
        assert list(conn.notifies(timeout=0.2)) == []  # the handle's waits keep their timeout
        with psycopg.connect(pg_dsn, autocommit=True) as other:
            other.execute(f"NOTIFY ch_{run_id}, 'hello'")
        wait_until(lambda: select.select([session.pgconn.socket], [], [], 0)[0], 5, "the notify")
        assert session.alive()
        assert session.alive()  # peeked, not taken: still there
        assert conn.execute("SELECT 1").fetchone() == (1,)
        assert [n.payload for n in conn.notifies(timeout=1, stop_after=1)] == ["hello"]
        with psycopg.connect(pg_dsn, autocommit=True) as other:
            other.execute("SELECT pg_terminate_backend(%s)", (session.backend_pid,))
        wait_until(lambda: not session.alive(), 5, "the session to read as dead")
        with pytest.raises(LockLost):
            held.release()
        assert not session.alive()  # closed now, and still dead


def test_a_session_discarded_is_forgotten(pg_dsn: str, run_id: str) -> None:
    with lock(pg_dsn, f"a:{run_id}", strategy="connect") as held:
        session = held._hold.session
        source = registry.source(held.config)
        assert session in source._sessions
    assert session not in source._sessions and session is not None and session.closed


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
