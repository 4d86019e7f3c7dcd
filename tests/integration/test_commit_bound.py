"""A commit that waits on synchronous replication has a bound its holder learns.

The server here names a synchronous standby that never connects, so every commit of a
write waits for it, as a primary's do under Patroni's strict synchronous mode while
replication is cut and the leader keeps its key. The library's own COMMIT (of
``lock.transaction()``) is bounded by the statement deadline: the holder gets LockLost
saying whether it committed is unknown, the name stays held by the server meanwhile
(fail closed), and the commit's outcome is settled only when replication returns. A
commit of the body's own (autocommit on ``lock.connection``, or its own transaction)
is found by the checks once it has waited as long, and the body is told the same.
"""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from pglock_celery import LockLost, TenantLockedTask, current_lock
from pglock_celery.session import STATEMENT_DEADLINE
from tests.support.locks import DEDICATED, eager_app, free_elsewhere, lock
from tests.support.services import EmbeddedPostgres, wait_until


@pytest.fixture
def waiting_server(tmp_path: Path) -> Iterator[EmbeddedPostgres]:
    """A server whose every commit of a write waits for a standby that never comes."""
    server = EmbeddedPostgres(tmp_path / "pg")
    server.init("synchronous_standby_names = 'nobody'")
    server.start()
    try:
        with psycopg.connect(server.dsn, autocommit=True) as conn:
            conn.execute("SET synchronous_commit = off")  # the set-up itself does not wait
            conn.execute("CREATE TABLE writes (name text NOT NULL)")
        yield server
    finally:
        server.destroy()


def replication_returns(server: EmbeddedPostgres) -> None:
    with psycopg.connect(server.dsn, autocommit=True) as conn:
        conn.execute("ALTER SYSTEM SET synchronous_standby_names = ''")
    server.reload()  # its files reachable first (tests/support: a pytest process closes them)


def written(server: EmbeddedPostgres, name: str) -> bool:
    with psycopg.connect(server.dsn) as conn:
        row = conn.execute("SELECT count(*) FROM writes WHERE name = %s", (name,)).fetchone()
    return bool(row and row[0])


@pytest.mark.parametrize("strategy", DEDICATED)
def test_a_commit_waiting_on_replication_ends_in_lock_lost_saying_its_outcome_is_unknown(
    waiting_server: EmbeddedPostgres, strategy: str
) -> None:
    name = f"commit-bound:{uuid.uuid4().hex[:8]}"
    held = lock(waiting_server.dsn, name, strategy=strategy)
    assert held.acquire()
    try:
        with pytest.raises(LockLost) as lost:
            with held.transaction() as conn:
                conn.execute("INSERT INTO writes VALUES (%s)", (name,))
        message = str(lost.value)
        assert f"did not answer the COMMIT within {STATEMENT_DEADLINE:g} s" in message, message
        assert "whether the transaction committed is unknown" in message, message
        assert held.loss is not None
        # The backend still waits in its commit: the name stays held (nobody else runs).
        assert not free_elsewhere(waiting_server.dsn, name)
        assert not written(waiting_server, name)
    finally:
        with contextlib.suppress(LockLost):
            held.release()
    replication_returns(waiting_server)
    # The commit went through once replication returned ("unknown" was the truth), and
    # the name is free once its backend, its client gone, ends.
    wait_until(lambda: written(waiting_server, name), 30, "the waiting commit to end")
    wait_until(lambda: free_elsewhere(waiting_server.dsn, name), 30, "the name to be free")


@pytest.mark.parametrize("strategy", DEDICATED)
def test_a_commit_of_the_bodys_own_waiting_on_replication_interrupts_the_body(
    waiting_server: EmbeddedPostgres, strategy: str
) -> None:
    """The body's own autocommit INSERT waits in its commit: the checks see its backend
    wait for synchronous replication, and once it has waited the statement deadline the
    body gets LockLost (its session cut), saying the outcome is unknown."""
    app = eager_app(waiting_server.dsn, "commit-bound", strategy=strategy, check_interval=0.5)
    name = f"commit-bound:{uuid.uuid4().hex[:8]}"

    @app.task(base=TenantLockedTask, lock_name="commit-bound:{tenant}", shared=False)
    def write(tenant: str) -> None:
        lock = current_lock()
        assert lock is not None
        lock.connection.execute("INSERT INTO writes VALUES (%s)", (lock.name,))

    result = write.apply(args=(name.split(":", 1)[1],))
    assert isinstance(result.result, LockLost), result.result
    message = str(result.result)
    assert "waited over" in message and "for synchronous replication" in message, message
    assert "whether it committed is unknown" in message, message
    assert not free_elsewhere(waiting_server.dsn, name)  # its backend still waits, holding it
    replication_returns(waiting_server)
    wait_until(lambda: written(waiting_server, name), 30, "the waiting commit to end")
    wait_until(lambda: free_elsewhere(waiting_server.dsn, name), 30, "the name to be free")


@pytest.fixture
def slow_standby(tmp_path: Path) -> Iterator[EmbeddedPostgres]:
    """A server whose commits each wait 0.3 s for 'the standby': a thread ends each
    wait then (pg_cancel_backend on a wait for replication gives the commit back,
    committed, as a standby's acknowledgement would)."""
    server = EmbeddedPostgres(tmp_path / "pg")
    server.init("synchronous_standby_names = 'standby'")
    server.start()
    stop = threading.Event()

    def acknowledge() -> None:
        with psycopg.connect(server.dsn, autocommit=True) as conn:
            while not stop.wait(0.02):  # the standby's pace
                conn.execute(
                    "SELECT pg_cancel_backend(pid) FROM pg_stat_activity"
                    " WHERE wait_event = 'SyncRep' AND now() - query_start > '0.3 s'"
                )

    try:
        with psycopg.connect(server.dsn, autocommit=True) as conn:
            conn.execute("SET synchronous_commit = off")
            conn.execute("CREATE TABLE writes (name text NOT NULL)")
        standby = threading.Thread(target=acknowledge, daemon=True)
        standby.start()
        yield server
        stop.set()
        standby.join(10)
    finally:
        stop.set()
        server.destroy()


@pytest.mark.parametrize("how", ["autocommit", "lock.transaction"])
def test_commits_that_each_wait_a_moment_for_replication_keep_the_lock(
    slow_standby: EmbeddedPostgres, how: str
) -> None:
    """Back to back for longer than the statement deadline, each commit waiting 0.3 s:
    no wait lasts long, so the body keeps its lock (each commit is a wait of its own)."""
    app = eager_app(slow_standby.dsn, "commit-bound-slow")
    waits: list[float] = []

    @app.task(base=TenantLockedTask, lock_name="commit-bound:{tenant}", shared=False)
    def write(tenant: str) -> int:
        lock = current_lock()
        assert lock is not None
        until = time.monotonic() + 2 * STATEMENT_DEADLINE
        while time.monotonic() < until:
            began = time.monotonic()
            if how == "autocommit":
                lock.connection.execute("INSERT INTO writes VALUES (%s)", (tenant,))
            else:
                with lock.transaction() as conn:
                    conn.execute("INSERT INTO writes VALUES (%s)", (tenant,))
            waits.append(time.monotonic() - began)
        return len(waits)

    result = write.apply(args=(uuid.uuid4().hex[:8],))
    assert not isinstance(result.result, BaseException), result.result
    assert result.result == len(waits) > 10
    assert min(waits) >= 0.25  # every commit did wait for 'the standby'
