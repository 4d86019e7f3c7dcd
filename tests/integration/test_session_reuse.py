"""G7, a session is handed out clean: the reuse strategy's idle lock-only sessions.

A released session goes back to the process's cache only when nothing of its holder
is left on it (client attributes, server settings, temp tables, prepared statements,
cursors, LISTEN, other advisory locks, a lock_timeout); else, or when its body failed,
left a transaction open or lost its lock, it is closed. A cached session that died is
replaced; at most pglock_idle_sessions are kept; the connect strategy keeps none.
"""

from __future__ import annotations

import itertools
import os
import tempfile

import psycopg
import pytest
from psycopg import pq
from psycopg.rows import dict_row, tuple_row

from pglock_celery import LockLost, LockTimeout, lock_key, try_lock
from pglock_celery.sources import registry
from tests.support.locks import finish, free_elsewhere, held_elsewhere, lock, terminate
from tests.support.services import scalar

pytestmark = pytest.mark.usefixtures("empty_cache")  # no idle session across tests


CHECK_INTERVAL = 0.2


# --- back to the cache, or closed -------------------------------------------------------


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


def test_the_release_of_a_used_handle_unlocks_and_resets_in_one_round_trip(
    pg_dsn: str, run_id: str
) -> None:
    """The unlock and DISCARD ALL both sent before any answer is read (libpq's trace of
    the release: two Syncs, then the server's messages), and the session kept."""
    first = lock(pg_dsn, f"a:{run_id}")
    assert first.acquire()
    first.connection.execute("SET work_mem = '7MB'")
    with tempfile.TemporaryFile("w+") as trace:
        first.connection.pgconn.trace(trace.fileno())  # no reference kept: it stays reusable
        first.connection.pgconn.set_trace_flags(
            pq.Trace.SUPPRESS_TIMESTAMPS | pq.Trace.REGRESS_MODE
        )
        first.release()
        assert registry.idle_count() == 1
        with lock(pg_dsn, f"b:{run_id}") as second:
            second.connection.pgconn.untrace()
            assert second.connection.execute("SHOW work_mem").fetchone() != ("7MB",)
        trace.seek(0)
        messages = [line.split("\t")[:3] for line in trace.read().splitlines()]
    sent_first = [kind for side, _, kind in itertools.takewhile(lambda m: m[0] == "F", messages)]
    assert sent_first.count("Sync") == 2, messages


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


def test_a_lost_lock_is_reported_and_its_session_is_not_kept(pg_dsn: str, run_id: str) -> None:
    with pytest.raises(LockLost), lock(pg_dsn, f"a:{run_id}") as held:
        held.connection.execute("SELECT pg_advisory_unlock_all()")
    assert registry.idle_count() == 0


def test_a_session_discarded_is_forgotten(pg_dsn: str, run_id: str) -> None:
    """A closed session leaves its source's bookkeeping (a test of sources/dedicated.py's state)."""
    with lock(pg_dsn, f"a:{run_id}", strategy="connect") as held:
        session = held._hold.session
        source = registry.source(held.config)
        assert session in source._sessions
    assert session not in source._sessions and session is not None and session.closed


def test_a_cached_session_that_died_is_replaced_before_locking(pg_dsn: str, run_id: str) -> None:
    with lock(pg_dsn, f"a:{run_id}") as first:
        backend = first.connection.info.backend_pid
    assert terminate(pg_dsn, backend)
    with lock(pg_dsn, f"a:{run_id}") as second:
        assert second.acquired
        assert second.connection.info.backend_pid != backend


# --- a reused session is pristine ---------------------------------------------------------


def test_a_reused_session_comes_back_pristine_client_and_server_side(
    pg_dsn: str, run_id: str, table: str
) -> None:
    with lock(pg_dsn, f"a:{run_id}", check_interval=CHECK_INTERVAL) as first:
        conn = first.connection
        backend = conn.info.backend_pid
        conn.execute("SET statement_timeout = 1234")
        conn.execute("SET search_path = nowhere")
        conn.execute("CREATE TEMP TABLE scratch (v int)")
        conn.execute("LISTEN somewhere")
        conn.autocommit = False
        conn.read_only = True
        conn.prepare_threshold = 0
        conn.row_factory = dict_row  # type: ignore[assignment]
        conn.execute("SELECT %s::int", (1,))
        conn.commit()
    assert registry.idle_count() == 1
    with lock(pg_dsn, f"b:{run_id}", check_interval=CHECK_INTERVAL) as second:
        conn = second.connection
        assert conn.info.backend_pid == backend  # the very session, reused
        assert conn.autocommit and conn.read_only is None and conn.row_factory is tuple_row
        assert conn.prepare_threshold == 5
        assert conn.execute("SHOW statement_timeout").fetchone() == ("0",)
        assert conn.execute("SHOW search_path").fetchone() == ('"$user", public',)
        assert conn.execute("SELECT to_regclass('pg_temp.scratch')").fetchone() == (None,)
        assert conn.execute("SELECT count(*) FROM pg_listening_channels()").fetchone() == (0,)
        for _ in range(3):  # prepared statements start afresh on the server too
            conn.execute("SELECT %s::int", (1,), prepare=True)
        with conn.transaction():
            conn.execute(f"INSERT INTO public.{table} VALUES (1)")
    assert scalar(pg_dsn, f"SELECT count(*) FROM {table}") == 1


def test_a_reused_session_shows_the_next_holder_no_server_state(pg_dsn: str, run_id: str) -> None:
    """Settings, role, temp table, statement, cursor, LISTEN, locks: all gone at reuse."""
    first = lock(pg_dsn, f"dirty:{run_id}")
    assert first.acquire()
    conn = first.connection
    for statement in (
        "SET search_path = pg_temp, public",
        "SET statement_timeout = '1234ms'",
        "SET lock_timeout = '77ms'",
        "SET idle_session_timeout = '1s'",
        "SET tcp_keepalives_idle = 999",
        "SET client_connection_check_interval = 0",
        "SET application_name = 'spoofed'",
        "SET pglock.held = ',1,'",
        "SET myapp.tenant = '42'",
        "CREATE TEMP TABLE body_temp (x int)",
        "PREPARE body_stmt AS SELECT 1",
        "DECLARE body_cur CURSOR WITH HOLD FOR SELECT 1",
        "LISTEN body_channel",
        "SELECT pg_advisory_lock_shared(12345)",
        "SET SESSION CHARACTERISTICS AS TRANSACTION ISOLATION LEVEL SERIALIZABLE",
        "SET default_transaction_read_only = on",
    ):
        conn.execute(statement)
    first.release()
    assert registry.idle_count() == 1
    nxt = lock(pg_dsn, f"clean:{run_id}")
    assert nxt.acquire()
    try:
        c = nxt.connection
        row = c.execute(
            "SELECT current_setting('search_path'), current_setting('statement_timeout'),"
            " current_setting('lock_timeout'), current_setting('idle_session_timeout'),"
            " current_setting('tcp_keepalives_idle'),"
            " current_setting('client_connection_check_interval'),"
            " current_setting('default_transaction_read_only'),"
            " current_setting('transaction_isolation'),"
            " (SELECT count(*) FROM pg_prepared_statements),"
            " (SELECT count(*) FROM pg_cursors),"
            " (SELECT count(*) FROM pg_listening_channels()),"
            " to_regclass('pg_temp.body_temp') IS NULL"
        ).fetchone()
        assert row == (
            '"$user", public',
            "0",
            "0",
            "0",
            "4",
            "3s",
            "off",
            "read committed",
            0,
            0,
            0,
            True,
        )
        assert free_elsewhere(pg_dsn, 12345)
    finally:
        nxt.release()


def test_other_advisory_locks_of_the_body_do_not_survive_in_the_cache(
    pg_dsn: str, run_id: str
) -> None:
    stray = lock_key(f"stray:{run_id}")
    with lock(pg_dsn, f"a:{run_id}") as held:
        held.connection.execute("SELECT pg_advisory_lock(%s)", (stray,))
    assert registry.idle_count() == 1
    with try_lock(stray, dsn=pg_dsn) as other:
        assert other.acquired


def test_a_holders_repeated_query_works_on_a_reused_session(pg_dsn: str, run_id: str) -> None:
    """A reused session is like a fresh one: a query run 8 times (psycopg prepares it) works."""
    for i in range(6):  # six plain holds on the one cached session
        holder = lock(pg_dsn, f"prep:{run_id}:{i}")
        assert holder.acquire()
        holder.release()
    assert registry.idle_count() == 1
    holder = lock(pg_dsn, f"prep:{run_id}")
    assert holder.acquire()
    try:
        for i in range(8):
            holder.connection.execute("SELECT %s::int", (i,))
    finally:
        finish(holder)


def test_a_session_serves_many_holders_that_use_their_handles(pg_dsn: str, run_id: str) -> None:
    backends = set()
    for round_ in range(12):  # past psycopg's prepare threshold, on both sides
        with lock(pg_dsn, f"a:{run_id}:{round_ % 2}", check_interval=CHECK_INTERVAL) as held:
            for _ in range(6):
                held.connection.execute("SELECT %s::int", (round_,))
            backends.add(held.connection.info.backend_pid)
    assert len(backends) == 1


# --- waits on a cached session, and the idle bound ------------------------------------------


def application_name_of(dsn: str, backend: int) -> str:
    """The application_name the server shows for ``backend``."""
    name = scalar(dsn, "SELECT application_name FROM pg_stat_activity WHERE pid = %s", (backend,))
    assert name is not None, f"backend {backend} is gone"
    return str(name)


def test_a_wait_with_a_timeout_on_a_cached_session_leaves_neither_timeout_nor_name(
    pg_dsn: str, run_id: str
) -> None:
    with lock(pg_dsn, f"warm:{run_id}") as warm:
        backend = warm.backend_pid
    with lock(pg_dsn, f"w:{run_id}", wait=True, timeout=5) as waited:
        assert waited.backend_pid == backend  # type: ignore[union-attr]
        # Named after its holder once granted.
        assert application_name_of(pg_dsn, backend).endswith(f"|w:{run_id}")
    assert registry.idle_count() == 1
    assert application_name_of(pg_dsn, backend) == f"pglock-idle|{os.getpid()}"
    with lock(pg_dsn, f"next:{run_id}") as following:
        conn = following.connection
        assert conn.info.backend_pid == backend  # the very session, reused again
        assert conn.execute("SHOW lock_timeout").fetchone() == ("0",)
        name = conn.execute("SHOW application_name").fetchone()
        assert name is not None and name[0].endswith(f"|next:{run_id}")


def test_a_wait_that_times_out_on_a_cached_session_leaves_no_timeout_behind(
    pg_dsn: str, run_id: str
) -> None:
    with lock(pg_dsn, f"warm:{run_id}"):
        pass
    other = held_elsewhere(pg_dsn, f"w:{run_id}")
    try:
        with pytest.raises(LockTimeout), lock(pg_dsn, f"w:{run_id}", wait=True, timeout=0.2):
            pytest.fail("the body ran without the lock")
    finally:
        other.close()
    with lock(pg_dsn, f"next:{run_id}") as following:
        conn = following.connection
        assert conn.execute("SHOW lock_timeout").fetchone() == ("0",)
    with lock(pg_dsn, f"w:{run_id}", wait=True) as free:
        assert free.acquired


def test_a_timed_out_wait_on_a_cached_session_leaves_nothing_behind(
    pg_dsn: str, run_id: str
) -> None:
    """LockTimeout on a cached session: no lock_timeout for the next holder, no lock."""
    warm = lock(pg_dsn, f"warm:{run_id}")
    assert warm.acquire()
    warm.release()
    assert registry.idle_count() == 1
    blocker = psycopg.connect(pg_dsn, autocommit=True)
    try:
        waiting = lock(pg_dsn, f"wait:{run_id}", wait=True, timeout=0.2)
        blocker.execute("SELECT pg_advisory_lock(%s::int8)", (waiting.key,))
        with pytest.raises(LockTimeout):
            waiting.acquire()
        blocker.execute("SELECT pg_advisory_unlock(%s::int8)", (waiting.key,))
        assert not waiting.acquired
        again = lock(pg_dsn, f"wait:{run_id}", wait=True, timeout=5)
        assert again.acquire()
        try:
            shown = again.connection.execute("SHOW lock_timeout").fetchone()
            assert shown == ("0",)
        finally:
            again.release()
        nxt = lock(pg_dsn, f"after:{run_id}")
        assert nxt.acquire()
        try:
            assert nxt.connection.execute("SHOW lock_timeout").fetchone() == ("0",)
        finally:
            nxt.release()
    finally:
        blocker.close()


def idle_sessions_on_server(dsn: str) -> int:
    return int(
        scalar(
            dsn,
            "SELECT count(*) FROM pg_stat_activity"
            " WHERE application_name = %s AND datname = current_database()",
            (f"pglock-idle|{os.getpid()}",),
        )
    )


@pytest.mark.parametrize("bound", [0, 2])
def test_a_process_keeps_at_most_idle_sessions_and_closes_the_others(
    pg_dsn: str, run_id: str, bound: int
) -> None:
    held = [lock(pg_dsn, f"b{n}:{run_id}", idle_sessions=bound) for n in range(4)]
    for one in held:
        assert one.acquire()
    for one in held:
        one.release()
    assert registry.idle_count() == bound
    assert idle_sessions_on_server(pg_dsn) == bound
    with lock(pg_dsn, f"again:{run_id}", idle_sessions=bound) as again:
        assert again.acquired
    assert registry.idle_count() == bound
