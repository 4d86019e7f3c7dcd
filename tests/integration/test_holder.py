"""pglock_celery.holder(): who holds a lock, any holder (a hand-rolled one too), asked by
name or key, on a short plain session of its own, in the database try_lock would use."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from celery import Celery

import pglock_celery.inspect as pglock_inspect
from pglock_celery import LockUnavailable, PglockError, holder, lock_key, try_lock
from pglock_celery.session import STATEMENT_DEADLINE
from tests.support.locks import lock
from tests.support.services import wait_until


@pytest.fixture
def hand_rolled(pg_dsn: str) -> Iterator[psycopg.Connection[Any]]:
    """A session of code that takes advisory locks itself, as the original write-up does."""
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        yield conn


def test_a_hand_rolled_holder_is_found_by_name_and_by_key(
    pg_dsn: str, run_id: str, hand_rolled: psycopg.Connection[Any]
) -> None:
    name = f"tenant:{run_id}"
    hand_rolled.execute("SELECT pg_advisory_lock(%s)", (lock_key(name),))
    by_name = holder(name, dsn=pg_dsn)
    by_key = holder(lock_key(name), dsn=pg_dsn)
    assert by_name is not None and by_key is not None
    assert by_name.backend_pid == by_key.backend_pid == hand_rolled.info.backend_pid
    assert (by_name.key, by_name.name, by_name.name_truncated) == (lock_key(name), name, False)
    assert (by_key.name, by_key.task_id, by_key.worker_pid) == (None, None, None)


def test_a_free_lock_has_no_holder(pg_dsn: str, run_id: str) -> None:
    assert holder(f"tenant:{run_id}", dsn=pg_dsn) is None


def test_a_library_holder_is_reported_with_its_process_and_host(pg_dsn: str, run_id: str) -> None:
    name = f"tenant:{run_id}"
    with try_lock(name, dsn=pg_dsn) as held:
        assert held.acquired
        found = holder(name, dsn=pg_dsn)
        backend = held.connection.info.backend_pid
    assert found is not None
    assert (found.backend_pid, found.name, found.worker_pid) == (backend, name, os.getpid())
    # The pid field carries the grant time too: pid.T (see pglock-celery locks).
    assert found.application_name.startswith(f"pglock|{os.getpid()}.")
    assert found.locked_at is not None


def test_two_long_names_sharing_their_first_60_bytes_never_get_each_others_holder(
    pg_dsn: str, run_id: str
) -> None:
    common = f"tenant:{run_id}:" + "x" * 60
    first, second = common + ":first", common + ":second"
    with try_lock(first, dsn=pg_dsn) as held:
        assert held.acquired
        assert holder(second, dsn=pg_dsn) is None
        found = holder(first, dsn=pg_dsn)
        by_key = holder(lock_key(first), dsn=pg_dsn)
    assert found is not None and (found.name, found.name_truncated) == (first, False)
    # Asked by key only, the name is what survived the cut, and says so.
    assert by_key is not None and by_key.name_truncated
    assert by_key.name is not None and first.startswith(by_key.name)


def test_without_dsn_it_asks_the_current_apps_database(
    app: Celery, pg_dsn: str, run_id: str, hand_rolled: psycopg.Connection[Any]
) -> None:
    app.set_current()
    name = f"tenant:{run_id}"
    hand_rolled.execute("SELECT pg_advisory_lock(%s)", (lock_key(name),))
    found = holder(name)
    assert found is not None and found.backend_pid == hand_rolled.info.backend_pid


def test_an_unreachable_database_is_lock_unavailable_without_its_password() -> None:
    dsn = "host=127.0.0.1 port=1 user=u password=Hunter2secret dbname=none connect_timeout=2"
    with pytest.raises(LockUnavailable) as raised:
        holder("tenant:1", dsn=dsn)
    assert "127.0.0.1:1" in str(raised.value)
    assert "Hunter2secret" not in str(raised.value)


def test_it_leaves_no_session_behind_and_holds_nothing(pg_dsn: str, run_id: str) -> None:
    def sessions_of_holder(conn: psycopg.Connection[Any]) -> int:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
            " AND pid <> pg_backend_pid() AND application_name LIKE 'pglock%%'"
        ).fetchone()
        return int(row[0]) if row else -1

    with psycopg.connect(pg_dsn, autocommit=True) as watcher:
        before = sessions_of_holder(watcher)
        assert holder(f"tenant:{run_id}", dsn=pg_dsn) is None
        # Its backend ends a moment after the client closed the socket.
        wait_until(lambda: sessions_of_holder(watcher) == before, 5, "holder()'s session to go")


@pytest.mark.parametrize(
    ("bad", "error"), [(None, TypeError), ("", ValueError), (2**64, ValueError)]
)
def test_a_bad_argument_is_refused_before_connecting(bad: Any, error: type[Exception]) -> None:
    with pytest.raises(error) as raised:
        holder(bad, dsn="host=127.0.0.1 port=1 dbname=none")
    assert isinstance(raised.value, PglockError)


def test_a_skip_reports_a_hand_rolled_holder_found_by_key(pg_dsn: str, run_id: str) -> None:
    """No library holder names the lock: the skip's report falls back to pg_locks."""
    name = f"hand:{run_id}"
    with psycopg.connect(pg_dsn, autocommit=True) as hand:
        hand.execute("SELECT pg_advisory_lock(%s)", (lock_key(name),))
        refused = lock(pg_dsn, name)
        assert not refused.acquire()
        found = refused.holder()
        refused.release()
        assert found is not None and found.backend_pid == hand.info.backend_pid


@pytest.mark.usefixtures("empty_cache")
def test_a_skips_lookup_by_key_on_a_frozen_backend_ends_within_the_statement_deadline(
    pg_dsn: str, run_id: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pg_locks fallback is bounded like every statement of the library's.

    The skipped lock's backend is stopped (SIGSTOP) just before the fallback is sent,
    after the lookup by name found no library holder: the lookup gives up within the
    deadline, reports no holder, and the lock lets its session go.
    """
    name = f"hand:{run_id}"
    with psycopg.connect(pg_dsn, autocommit=True) as hand:
        hand.execute("SELECT pg_advisory_lock(%s)", (lock_key(name),))
        refused = lock(pg_dsn, name)
        assert not refused.acquire()
        (backend,) = hand.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database()"
            " AND application_name LIKE %s",
            (f"%{os.getpid()}%",),
        ).fetchone() or (None,)
        assert backend is not None
        stopped: list[int] = []
        to_fields = pglock_inspect.key_to_lock_fields

        def stop_backend_first(key: int) -> tuple[int, int]:
            os.kill(backend, signal.SIGSTOP)
            stopped.append(backend)
            return to_fields(key)

        monkeypatch.setattr(pglock_inspect, "key_to_lock_fields", stop_backend_first)
        found: list[object] = []
        looking = threading.Thread(target=lambda: found.append(refused.holder()))
        looking.start()
        try:
            looking.join(STATEMENT_DEADLINE + 3)
            answered = not looking.is_alive()
        finally:
            if stopped:
                os.kill(backend, signal.SIGCONT)
        looking.join(10)
        refused.release()
    assert stopped, "the lookup by key was reached"
    assert answered, "the lookup by key waited past the statement deadline"
    assert found == [None]
