"""G4 behind a connection pooler: a real PgBouncer, in session and in transaction mode.

A lock session must be a backend of its own: behind a transaction pooler, or a session
pooler not declared with pglock_pooler = "session", no body runs (fail closed), even
when the pooler drops the client's startup options; a declared session pooler works,
with the lock session's settings in force, and its sessions are never reused.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import pytest

from pglock_celery import LockLost, LockUnavailable
from pglock_celery.sources import registry
from tests.support.locks import free_elsewhere, lock
from tests.support.pgbouncer import pgbouncer

pytestmark = pytest.mark.usefixtures("empty_cache")  # no idle session across tests


CHECK_INTERVAL = 0.2
shared_lock = partial(lock, strategy="shared", check_interval=CHECK_INTERVAL)


@pytest.fixture
def transaction_pooler(pg_dsn: str, tmp_path: Path) -> Iterator[str]:
    """PgBouncer in transaction mode that drops the client's startup options."""
    with pgbouncer(pg_dsn, tmp_path, mode="transaction", ignore_options=True) as through:
        yield through


@pytest.fixture
def transaction_pooler_of_one(pg_dsn: str, tmp_path: Path) -> Iterator[str]:
    """The same with one server session: every client's statements go to one backend."""
    with pgbouncer(
        pg_dsn, tmp_path, mode="transaction", pool_size=1, ignore_options=True
    ) as through:
        yield through


@pytest.fixture
def session_pooler(pg_dsn: str, tmp_path: Path) -> Iterator[str]:
    """PgBouncer in session mode that drops the client's startup options."""
    with pgbouncer(pg_dsn, tmp_path, mode="session", ignore_options=True) as through:
        yield through


# --- a transaction pooler: no body runs ------------------------------------------------------


@pytest.mark.parametrize("strategy", ["reuse", "connect"])
def test_behind_a_transaction_pooler_that_drops_options_no_body_runs(
    transaction_pooler: str, run_id: str, strategy: str
) -> None:
    for _ in range(3):
        with pytest.raises(LockUnavailable, match="pooler"):
            with lock(
                transaction_pooler, f"t:{run_id}", strategy=strategy, check_interval=CHECK_INTERVAL
            ):
                pytest.fail("the body ran on a session that is not a backend of its own")


def test_a_transaction_pooler_is_refused_by_default(
    transaction_pooler_of_one: str, run_id: str
) -> None:
    """With the default pglock_pooler = "none", a PgBouncer is refused (fail closed)."""
    holder = lock(transaction_pooler_of_one, f"bouncer2:{run_id}")
    with pytest.raises(LockUnavailable, match="pooler"):
        holder.acquire()
    assert not holder.acquired


def test_two_holders_through_a_transaction_pooler_never_both_hold(
    transaction_pooler_of_one: str, pg_dsn: str, run_id: str
) -> None:
    """Told "session" but put behind a transaction-mode pooler: never two holders of one name."""
    name = f"bouncer:{run_id}"
    first = lock(transaction_pooler_of_one, name, pooler="session")
    second = lock(transaction_pooler_of_one, name, pooler="session")
    try:
        assert first.acquire()
        try:
            both = second.acquire()
        except LockUnavailable:
            both = False  # refusing is fine: failing closed
        assert not both, "two lock objects hold the same name at once through the pooler"
    finally:
        for holder in (second, first):
            with contextlib.suppress(LockLost, LockUnavailable):
                holder.release()
        registry.close()


# --- a session pooler: declared, it works; undeclared, it fails closed -----------------------


def test_behind_a_session_pooler_without_the_setting_it_fails_closed(
    session_pooler: str, run_id: str
) -> None:
    with pytest.raises(LockUnavailable, match='pglock_pooler = "session"'):
        with lock(session_pooler, f"t:{run_id}", check_interval=CHECK_INTERVAL):
            pytest.fail("the body ran")


def test_a_declared_session_pooler_works_with_the_settings_in_force(
    session_pooler: str, pg_dsn: str, run_id: str
) -> None:
    with lock(
        session_pooler, f"t:{run_id}", pooler="session", check_interval=CHECK_INTERVAL
    ) as held:
        assert held.acquired and not free_elsewhere(pg_dsn, f"t:{run_id}")
        shown = held.connection.execute(
            "SELECT current_setting('tcp_user_timeout'), current_setting('idle_session_timeout')"
        ).fetchone()
        assert shown in (("12s", "0"), ("12000", "0"))  # shown from the socket: no unit
    assert free_elsewhere(pg_dsn, f"t:{run_id}")
    assert registry.idle_count() == 0  # a pooled session is never reused


def test_a_session_pooler_excludes_and_is_never_reused(
    session_pooler: str, pg_dsn: str, run_id: str
) -> None:
    """Behind a session-mode pooler, one holder at a time, and no session is cached."""
    name = f"bouncer3:{run_id}"
    first = lock(session_pooler, name, pooler="session")
    second = lock(session_pooler, name, pooler="session")
    assert first.acquire()
    try:
        assert not second.acquire()
        second.release()
        assert not free_elsewhere(pg_dsn, first.key)
    finally:
        first.release()
    assert registry.idle_count() == 0
