"""G11 completed: a loss is handled whole, and a fenced transaction proves its lock.

Whoever finds a loss (the monitor, or the body itself through ``held()``), the lock's
session is cut off before anyone is told, so no statement of the lost holder runs
after; ``held()`` returns a bool and raises nothing, also inside a task whose body
would be interrupted; ``lock.transaction()`` on a session that lost its lock while
staying alive raises LockLost at once, never waiting for the name's new holder and
never taking the lock back.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from typing import Any

import psycopg
import pytest

from pglock_celery import LockLost, TenantLockedTask, current_lock
from pglock_celery.loss import LossKind
from pglock_celery.session import STATEMENT_DEADLINE
from tests.support.locks import DEDICATED, eager_app, free_elsewhere, held_elsewhere, lock
from tests.support.services import wait_until

pytestmark = pytest.mark.usefixtures("empty_cache")


def backend_gone(admin: psycopg.Connection[Any], pid: int) -> bool:
    return admin.execute("SELECT 1 FROM pg_stat_activity WHERE pid = %s", (pid,)).fetchone() is None


@pytest.mark.parametrize("strategy", DEDICATED)
def test_a_loss_the_body_finds_itself_ends_the_session_before_the_body_hears_of_it(
    pg_dsn: str, admin: psycopg.Connection[Any], run_id: str, strategy: str
) -> None:
    """Inside a task (on_lost interrupt), the body's own held() finds its lock gone:
    held() returns False without raising, and the lock's connection runs nothing more."""
    app = eager_app(pg_dsn, strategy=strategy, check_interval=60)  # the monitor stays away
    seen: dict[str, Any] = {}

    @app.task(base=TenantLockedTask, lock_name="whole:{tenant}", shared=False)
    def step(tenant: str) -> None:
        held = current_lock()
        assert held is not None
        conn = held.connection
        seen["backend"] = held.backend_pid
        conn.execute("SELECT pg_advisory_unlock_all()")  # the body frees its own lock
        seen["held"] = held.held()
        seen["loss"] = held.loss
        try:
            conn.execute("SELECT 1")
            seen["after"] = "ran"
        except (psycopg.Error, LockLost) as exc:
            seen["after"] = type(exc).__name__

    result = step.apply((run_id,))
    assert seen["held"] is False
    assert seen["loss"] is not None and seen["loss"].kind is LossKind.LOCK_GONE
    assert seen["after"] != "ran", "a statement of the lost holder ran after its loss was found"
    assert isinstance(result.result, LockLost)  # the call ends with the loss, at release
    wait_until(lambda: backend_gone(admin, seen["backend"]), 5, "the lost session to end")
    assert free_elsewhere(pg_dsn, f"whole:{run_id}")


@pytest.mark.parametrize("strategy", DEDICATED)
def test_ensure_held_raises_lock_lost_once_the_session_is_already_cut(
    pg_dsn: str, admin: psycopg.Connection[Any], run_id: str, strategy: str
) -> None:
    """ensure_held() on a lock gone from a live session: LockLost, and by then the
    session is cut (the holder's next statement fails)."""
    held = lock(pg_dsn, f"e:{run_id}", strategy=strategy, check_interval=60)
    assert held.acquire()
    conn = held.connection
    conn.execute("SELECT pg_advisory_unlock_all()")
    with pytest.raises(LockLost):
        held.ensure_held()
    with pytest.raises(psycopg.OperationalError):
        conn.execute("SELECT 1")
    with pytest.raises(LockLost):
        held.release()


@pytest.mark.parametrize("strategy", DEDICATED)
def test_a_transaction_on_a_lock_lost_from_a_live_session_refuses_at_once_and_takes_nothing(
    pg_dsn: str, run_id: str, table: str, strategy: str
) -> None:
    """The body unlocked its own lock, another session took the name: lock.transaction()
    raises LockLost at once (it never waits for that holder), and nothing commits."""
    name = f"t:{run_id}"
    held = lock(pg_dsn, name, strategy=strategy, check_interval=60)
    assert held.acquire()
    held.connection.execute("SELECT pg_advisory_unlock_all()")
    other = held_elsewhere(pg_dsn, name)  # the name's new holder
    try:
        started = time.monotonic()
        with pytest.raises(LockLost), held.transaction() as conn:
            conn.execute(f"INSERT INTO {table} VALUES (101)")
        took = time.monotonic() - started
        assert took < 1.0, f"the transaction waited {took:.1f} s for the name's new holder"
        with psycopg.connect(pg_dsn) as check:
            assert check.execute(f"SELECT count(*) FROM {table}").fetchone() == (0,)
        assert held.loss is not None and held.loss.kind is LossKind.LOCK_GONE
        with pytest.raises(LockLost):
            held.release()
    finally:
        other.close()


@pytest.mark.parametrize("strategy", DEDICATED)
def test_a_transaction_on_a_lock_lost_with_the_name_free_does_not_take_it_back(
    pg_dsn: str, run_id: str, table: str, strategy: str
) -> None:
    """Lost while nobody else took the name: the transaction still refuses (LockLost), and
    afterwards the name is free on the server, not held again by the lost session."""
    name = f"f:{run_id}"
    held = lock(pg_dsn, name, strategy=strategy, check_interval=60)
    assert held.acquire()
    held.connection.execute("SELECT pg_advisory_unlock_all()")
    with pytest.raises(LockLost), held.transaction() as conn:
        conn.execute(f"INSERT INTO {table} VALUES (1)")
    assert free_elsewhere(pg_dsn, name)
    with psycopg.connect(pg_dsn) as check:
        assert check.execute(f"SELECT count(*) FROM {table}").fetchone() == (0,)
    with pytest.raises(LockLost):
        held.release()


@pytest.mark.parametrize("strategy", DEDICATED)
def test_a_transaction_proves_its_lock_and_commits_while_it_is_held(
    pg_dsn: str, run_id: str, table: str, strategy: str
) -> None:
    """The proof leaves a held lock held: the write commits, the lock stays, and unlocking
    once inside the transaction is put back before it ends."""
    name = f"ok:{run_id}"
    held = lock(pg_dsn, name, strategy=strategy, check_interval=60)
    assert held.acquire()
    with held.transaction() as conn:
        conn.execute(f"INSERT INTO {table} VALUES (1)")
        conn.execute("SELECT pg_advisory_unlock(%s)", (held.key,))
        assert not free_elsewhere(pg_dsn, name)
    assert held.held()
    assert not free_elsewhere(pg_dsn, name)
    held.release()
    with psycopg.connect(pg_dsn) as check:
        assert check.execute(f"SELECT count(*) FROM {table}").fetchone() == (1,)
    assert free_elsewhere(pg_dsn, name)


@pytest.mark.parametrize("strategy", DEDICATED)
def test_a_statement_still_running_when_its_lock_is_found_gone_commits_nothing(
    pg_dsn: str, admin: psycopg.Connection[Any], run_id: str, table: str, strategy: str
) -> None:
    """The holder's own statement frees the lock and runs on (a sleep, then a write): the
    monitor finds the key free from outside, ends the backend and waits for it before
    anyone is told, so the write after the loss never commits."""
    held = lock(pg_dsn, f"run:{run_id}", strategy=strategy, check_interval=0.2)
    assert held.acquire()
    conn = held.connection
    backend = held.backend_pid
    assert backend is not None
    with contextlib.suppress(psycopg.Error):
        conn.execute(  # one simple query: three statements the server runs in a row
            f"SELECT pg_advisory_unlock_all(); SELECT pg_sleep(3); INSERT INTO {table} VALUES (1)"
        )
    assert held.loss is not None and held.loss.kind is LossKind.LOCK_GONE
    wait_until(lambda: backend_gone(admin, backend), 5, "the lost session to end")
    with psycopg.connect(pg_dsn) as check:
        assert check.execute(f"SELECT count(*) FROM {table}").fetchone() == (0,)
    with pytest.raises(LockLost):
        held.release()


@pytest.mark.parametrize("strategy", DEDICATED)
def test_a_transaction_on_a_frozen_backend_ends_with_lock_lost_within_the_deadline(
    pg_dsn: str, run_id: str, table: str, strategy: str
) -> None:
    """The transaction's own statements (BEGIN, the proof, COMMIT) are the library's and
    bounded: on a backend that stops answering it fails with LockLost, never waits on."""
    held = lock(pg_dsn, f"frozen:{run_id}", strategy=strategy, check_interval=60)
    assert held.acquire()
    backend = held.backend_pid
    assert backend is not None
    outcome: list[BaseException | str] = []

    def write() -> None:
        try:
            with held.transaction() as conn:
                conn.execute(f"INSERT INTO {table} VALUES (1)")
            outcome.append("committed")
        except BaseException as exc:
            outcome.append(exc)

    os.kill(backend, signal.SIGSTOP)
    try:
        thread = threading.Thread(target=write)
        thread.start()
        thread.join(STATEMENT_DEADLINE + 5)
        ended = not thread.is_alive()
    finally:
        os.kill(backend, signal.SIGCONT)
    thread.join(10)
    assert ended, "the transaction waited on a frozen backend past its deadline"
    assert len(outcome) == 1 and isinstance(outcome[0], LockLost), outcome
    assert held.loss is not None and held.loss.kind is LossKind.CANNOT_TELL
    with psycopg.connect(pg_dsn) as check:
        assert check.execute(f"SELECT count(*) FROM {table}").fetchone() == (0,)
    with pytest.raises(LockLost):
        held.release()


@pytest.mark.parametrize("strategy", DEDICATED)
def test_a_transaction_nested_in_the_bodys_own_proves_the_lock_too(
    pg_dsn: str, run_id: str, table: str, strategy: str
) -> None:
    """Inside a transaction the body began itself (no pin), after its own unlock:
    lock.transaction() is a savepoint that proves the lock all the same, and refuses."""
    held = lock(pg_dsn, f"nest:{run_id}", strategy=strategy, check_interval=60)
    assert held.acquire()
    conn = held.connection
    conn.execute("BEGIN")
    conn.execute("SELECT pg_advisory_unlock_all()")
    with pytest.raises(LockLost), held.transaction() as inner:
        inner.execute(f"INSERT INTO {table} VALUES (1)")
    with contextlib.suppress(psycopg.Error):
        conn.execute("COMMIT")
    with psycopg.connect(pg_dsn) as check:
        assert check.execute(f"SELECT count(*) FROM {table}").fetchone() == (0,)
    with pytest.raises(LockLost):
        held.release()


@pytest.mark.parametrize("strategy", DEDICATED)
def test_checking_a_lock_its_holder_freed_refuses_others_only_until_the_loss_is_found(
    pg_dsn: str, run_id: str, strategy: str
) -> None:
    """A holder frees its own lock by SQL; its checks (every 10 ms) pin the key for one
    statement each, so another session's try may be refused meanwhile (known limit 4):
    never once the loss is found, and then the name is free at once."""
    held = lock(pg_dsn, f"pinned:{run_id}", strategy=strategy, check_interval=0.01)
    assert held.acquire()
    held.connection.execute("SELECT pg_advisory_unlock_all()")
    refused_after_found = 0
    with psycopg.connect(pg_dsn, autocommit=True) as other:
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            found = held.loss is not None
            if free_elsewhere(other, held.key):
                if found:
                    break
            elif found:
                refused_after_found += 1
        assert held.loss is not None and held.loss.kind is LossKind.LOCK_GONE
        assert free_elsewhere(other, held.key), "the name stayed taken after the loss was found"
    assert refused_after_found == 0, f"{refused_after_found} tries refused after the loss was found"
    with pytest.raises(LockLost):
        held.release()
