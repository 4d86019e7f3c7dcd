"""Adversarial: one lock object acquired again, dropped without release, waiting with timeouts."""

from __future__ import annotations

import contextlib
import gc

import psycopg
import pytest

from pglock_celery import LockLost, LockTimeout
from pglock_celery.sources import registry
from tests.adversary_helpers import make_lock, taken_elsewhere
from tests.helpers.services import wait_until


@pytest.fixture(autouse=True)
def empty_cache() -> None:
    registry.close()


def test_a_polled_lock_object_dropped_later_leaves_another_holder_alone(
    pg_dsn: str, run_id: str
) -> None:
    """Polling acquire() until granted, releasing, then dropping the object frees nobody's lock."""
    blocker = psycopg.connect(pg_dsn, autocommit=True)
    try:
        poll = make_lock(pg_dsn, f"adv:poll:{run_id}")
        blocker.execute("SELECT pg_advisory_lock(%s::int8)", (poll.key,))
        assert not poll.acquire()  # busy: the object keeps its session for the next poll
        blocker.execute("SELECT pg_advisory_unlock(%s::int8)", (poll.key,))
        assert poll.acquire()  # the documented second try
        poll.release()  # clean: the session goes back to the cache
        other = make_lock(pg_dsn, f"adv:other:{run_id}")
        assert other.acquire()  # checks out that very session
        try:
            del poll  # the polling loop moves on to its next tenant
            gc.collect()
            assert other.held(), f"dropping a released object ended {other.label}'s hold"
            assert not taken_elsewhere(pg_dsn, other.key)
        finally:
            with contextlib.suppress(LockLost):
                other.release()
    finally:
        blocker.close()


def test_a_lock_dropped_without_release_is_freed(pg_dsn: str, run_id: str) -> None:
    """Probe: an acquired object that is dropped (refcount, then in a cycle) frees its lock."""
    lock = make_lock(pg_dsn, f"adv:drop:{run_id}")
    key = lock.key
    assert lock.acquire()
    conn = lock.connection
    del lock
    # Freed by the monitor thread (a finalizer only hands the work on), within a tick.
    wait_until(lambda: taken_elsewhere(pg_dsn, key), 2, "the dropped lock to be freed")
    with pytest.raises(psycopg.Error):
        conn.execute("SELECT 1")

    cyclic = make_lock(pg_dsn, f"adv:drop2:{run_id}")
    assert cyclic.acquire()
    cyclic.self_ref = cyclic  # type: ignore[attr-defined]
    key = cyclic.key
    del cyclic
    gc.collect()
    wait_until(lambda: taken_elsewhere(pg_dsn, key), 2, "the dropped lock to be freed")
    assert registry.idle_count() == 0


def test_a_timed_out_wait_on_a_cached_session_leaves_nothing_behind(
    pg_dsn: str, run_id: str
) -> None:
    """Probe: LockTimeout on a cached session: no lock_timeout for the next holder, no lock."""
    warm = make_lock(pg_dsn, f"adv:warm:{run_id}")
    assert warm.acquire()
    warm.release()
    assert registry.idle_count() == 1
    blocker = psycopg.connect(pg_dsn, autocommit=True)
    try:
        waiting = make_lock(pg_dsn, f"adv:wait:{run_id}", wait=True, timeout=0.2)
        blocker.execute("SELECT pg_advisory_lock(%s::int8)", (waiting.key,))
        with pytest.raises(LockTimeout):
            waiting.acquire()
        blocker.execute("SELECT pg_advisory_unlock(%s::int8)", (waiting.key,))
        assert not waiting.acquired
        again = make_lock(pg_dsn, f"adv:wait:{run_id}", wait=True, timeout=5)
        assert again.acquire()
        try:
            shown = again.connection.execute("SHOW lock_timeout").fetchone()
            assert shown == ("0",)
        finally:
            again.release()
        nxt = make_lock(pg_dsn, f"adv:after:{run_id}")
        assert nxt.acquire()
        try:
            assert nxt.connection.execute("SHOW lock_timeout").fetchone() == ("0",)
        finally:
            nxt.release()
    finally:
        blocker.close()


def test_a_reused_session_shows_the_next_holder_no_server_state(pg_dsn: str, run_id: str) -> None:
    """Probe: settings, role, temp table, statement, cursor, LISTEN, locks: all gone at reuse."""
    first = make_lock(pg_dsn, f"adv:dirty:{run_id}")
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
        "CREATE TEMP TABLE adv_temp (x int)",
        "PREPARE adv_stmt AS SELECT 1",
        "DECLARE adv_cur CURSOR WITH HOLD FOR SELECT 1",
        "LISTEN adv_channel",
        "SELECT pg_advisory_lock_shared(12345)",
        "SET SESSION CHARACTERISTICS AS TRANSACTION ISOLATION LEVEL SERIALIZABLE",
        "SET default_transaction_read_only = on",
    ):
        conn.execute(statement)
    first.release()
    assert registry.idle_count() == 1
    nxt = make_lock(pg_dsn, f"adv:clean:{run_id}")
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
            " to_regclass('pg_temp.adv_temp') IS NULL"
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
        assert taken_elsewhere(pg_dsn, 12345)
    finally:
        nxt.release()
