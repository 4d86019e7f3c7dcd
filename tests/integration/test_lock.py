"""try_lock / wait_lock against a real Postgres."""

from __future__ import annotations

import os
import threading
import uuid

import psycopg
import pytest

from pglock_celery import LockLost, LockTimeout, LockUnavailable, lock_key, try_lock, wait_lock
from pglock_celery.inspect import find_holder, list_holders
from tests.support.locks import terminate
from tests.support.services import wait_until


def test_second_try_lock_on_a_held_name_is_refused(pg_dsn: str, run_id: str) -> None:
    with try_lock(f"t:{run_id}", dsn=pg_dsn) as first:
        assert first.acquired
        with try_lock(f"t:{run_id}", dsn=pg_dsn) as second:
            assert not second.acquired
    with try_lock(f"t:{run_id}", dsn=pg_dsn) as third:
        assert third.acquired


def test_lock_exposes_name_key_and_an_autocommit_connection(pg_dsn: str, run_id: str) -> None:
    with try_lock(f"t:{run_id}", dsn=pg_dsn) as lock:
        assert lock.name == f"t:{run_id}"
        assert lock.key == lock_key(f"t:{run_id}")
        assert lock.connection.autocommit
        app_name = lock.connection.execute("SHOW application_name").fetchone()
        assert app_name is not None and app_name[0].endswith(f"|t:{run_id}")


def test_lock_session_sets_its_own_safety_settings(pg_dsn: str, run_id: str) -> None:
    with try_lock(f"t:{run_id}", dsn=pg_dsn) as lock:
        conn = lock.connection
        shown = {
            name: conn.execute(f"SHOW {name}").fetchone()[0]  # type: ignore[index]
            for name in (
                "idle_session_timeout",
                "idle_in_transaction_session_timeout",
                "client_connection_check_interval",
                "tcp_keepalives_idle",
                "tcp_keepalives_count",
                "tcp_user_timeout",
            )
        }
    assert shown["idle_session_timeout"] == "0"
    assert shown["idle_in_transaction_session_timeout"] == "0"
    assert shown["client_connection_check_interval"] == "3s"
    assert shown["tcp_keepalives_idle"] == "4"
    assert shown["tcp_keepalives_count"] == "4"
    assert shown["tcp_user_timeout"] == "12000"


def test_bare_negative_key_is_held_and_released(pg_dsn: str) -> None:
    key = -(2**63) + 12345
    with try_lock(key, dsn=pg_dsn) as lock:
        assert lock.name is None and lock.key == key
        assert lock.held()
        with try_lock(key, dsn=pg_dsn) as other:
            assert not other.acquired
    with try_lock(key, dsn=pg_dsn) as again:
        assert again.acquired


def test_held_is_false_and_ensure_held_raises_after_the_session_is_killed(
    pg_dsn: str, run_id: str
) -> None:
    lock = try_lock(f"t:{run_id}", dsn=pg_dsn)
    with pytest.raises(LockLost, match="was lost"):
        with lock:
            assert lock.held()
            assert terminate(pg_dsn, lock.connection.info.backend_pid)
            assert not lock.held()
            with pytest.raises(LockLost, match=f"t:{run_id}"):
                lock.ensure_held()


def test_body_exception_wins_over_a_lost_lock_at_release(pg_dsn: str, run_id: str) -> None:
    with pytest.raises(ZeroDivisionError):
        with try_lock(f"t:{run_id}", dsn=pg_dsn) as lock:
            assert terminate(pg_dsn, lock.connection.info.backend_pid)
            1 / 0  # noqa: B018


def test_a_write_through_a_lost_lock_fails(pg_dsn: str, run_id: str) -> None:
    with psycopg.connect(pg_dsn, autocommit=True) as setup:
        setup.execute(f"CREATE TABLE fenced_{run_id} (v int)")
    try:
        with pytest.raises(LockLost):
            with try_lock(f"t:{run_id}", dsn=pg_dsn) as lock:
                assert terminate(pg_dsn, lock.connection.info.backend_pid)
                with pytest.raises(psycopg.OperationalError):
                    with lock.connection.transaction():
                        lock.connection.execute(f"INSERT INTO fenced_{run_id} VALUES (1)")
        with psycopg.connect(pg_dsn) as check:
            assert check.execute(f"SELECT count(*) FROM fenced_{run_id}").fetchone() == (0,)
    finally:
        with psycopg.connect(pg_dsn, autocommit=True) as setup:
            setup.execute(f"DROP TABLE fenced_{run_id}")


def test_open_transaction_is_rolled_back_at_release(pg_dsn: str, run_id: str) -> None:
    with psycopg.connect(pg_dsn, autocommit=True) as setup:
        setup.execute(f"CREATE TABLE open_{run_id} (v int)")
    try:
        with try_lock(f"t:{run_id}", dsn=pg_dsn) as lock:
            lock.connection.execute("BEGIN")
            lock.connection.execute(f"INSERT INTO open_{run_id} VALUES (1)")
        with psycopg.connect(pg_dsn) as check:
            assert check.execute(f"SELECT count(*) FROM open_{run_id}").fetchone() == (0,)
    finally:
        with psycopg.connect(pg_dsn, autocommit=True) as setup:
            setup.execute(f"DROP TABLE open_{run_id}")


def test_a_transaction_begun_after_its_lock_was_released_never_runs_on_the_next_holders_session(
    pg_dsn: str, run_id: str
) -> None:
    """lock.transaction() made, the lock released (a thread the body left running, say),
    the session handed to the next holder of the same name: entering the old block is
    refused before any statement of it reaches the next holder's session (under
    strategy reuse it is the same session: the block proving "its" key there would
    succeed)."""
    lock = try_lock(f"t:{run_id}", dsn=pg_dsn)
    lock.acquire()
    block = lock.transaction()
    lock.release()
    with try_lock(f"t:{run_id}", dsn=pg_dsn) as next_holder:
        assert next_holder.acquired
        with pytest.raises(psycopg.OperationalError, match="released"):
            with block:
                pytest.fail("the released lock's transaction began")
        status = next_holder.connection.info.transaction_status
        assert status == psycopg.pq.TransactionStatus.IDLE
        assert next_holder.held()


def test_wait_lock_times_out_while_another_session_holds_it(pg_dsn: str, run_id: str) -> None:
    with try_lock(f"t:{run_id}", dsn=pg_dsn) as holder:
        assert holder.acquired
        with pytest.raises(LockTimeout, match=r"0\.2 s"):
            with wait_lock(f"t:{run_id}", dsn=pg_dsn, timeout=0.2):
                pytest.fail("the body ran without the lock")


def test_wait_lock_gets_the_lock_once_the_holder_releases(pg_dsn: str, run_id: str) -> None:
    holder = try_lock(f"t:{run_id}", dsn=pg_dsn)
    holder.acquire()
    waited = threading.Event()

    def waiter() -> None:
        with wait_lock(f"t:{run_id}", dsn=pg_dsn, timeout=10) as lock:
            assert lock.held()
            waited.set()

    thread = threading.Thread(target=waiter)
    thread.start()
    # The waiter shows up in pg_locks as not granted before the holder lets go.
    wait_until(lambda: _waiting_sessions(pg_dsn, lock_key(f"t:{run_id}")) == 1, 5, "waiter")
    assert not waited.is_set()
    holder.release()
    thread.join(10)
    assert waited.is_set()


def _waiting_sessions(dsn: str, key: int) -> int:
    from pglock_celery.keys import key_to_lock_fields

    with psycopg.connect(dsn) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
            " AND classid = %s::int8::oid AND objid = %s::int8::oid",
            key_to_lock_fields(key),
        ).fetchone()
    return int(row[0]) if row else 0


def test_unreachable_dsn_names_host_and_port_but_never_the_password(run_id: str) -> None:
    dsn = "postgresql://app:s3cret-pw@127.0.0.1:1/test"
    with pytest.raises(LockUnavailable) as raised:
        with try_lock(f"t:{run_id}", dsn=dsn):
            pytest.fail("the body ran without the lock")
    message = str(raised.value)
    assert "127.0.0.1:1" in message
    assert "s3cret-pw" not in message


@pytest.mark.parametrize(
    "name",
    ["租户:é", "line\nbreak", "tenant:6f1c2f9e-0d4b-4b8e-9c55-3f3b2a1d7e90", "=odd", "租户" * 30],
)
def test_the_holder_of_any_name_is_reported_whole(pg_dsn: str, name: str) -> None:
    name = f"{name}:{uuid.uuid4().hex[:6]}"
    with try_lock(name, dsn=pg_dsn) as held, try_lock(name, dsn=pg_dsn) as skipped:
        assert held.acquired and not skipped.acquired
        holder = skipped.holder()
        assert holder is not None
        assert (holder.name, holder.worker_pid) == (name, os.getpid())
        assert holder.worker_host and holder.backend_pid == held.connection.info.backend_pid
        with psycopg.connect(pg_dsn, autocommit=True) as other:
            listed = [h for h in list_holders(other) if h.key == held.key]
            seen = find_holder(other, held.key)
        assert len(listed) == 1 and seen is not None and seen.worker_pid == os.getpid()
        if len(name.encode()) < 20:  # short enough to fit whole: listed by name too
            assert listed[0].name == name
