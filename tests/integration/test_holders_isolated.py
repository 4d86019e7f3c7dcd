"""No holder's action (an error, a timeout, a statement) frees or weakens another holder's lock.

Most of it concerns strategy ``shared``, where holders share a session; the fences of
``lock.transaction()`` are checked under every strategy.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import psycopg
import pytest

from pglock_celery import LockUnavailable, install_guard, remove_guard
from tests.support.locks import STRATEGIES, free_elsewhere, lock

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


GEVENT_TIMEOUT_IN_TRANSACTION = """
from gevent import monkey
monkey.patch_all()
import json, sys, time
import gevent, psycopg
from pglock_celery.config import PglockConfig
from pglock_celery.lock import AdvisoryLock
from tests.support.locks import free_elsewhere

dsn, run_id = sys.argv[1], sys.argv[2]
config = PglockConfig(dsn=dsn, strategy="shared", shared_sessions=1, check_interval=0.2)
other = AdvisoryLock(f"t:B:{run_id}", config=config)
assert other.acquire()
timed = AdvisoryLock(f"t:A:{run_id}", config=config)
assert timed.acquire()
timed_out = False
try:
    with gevent.Timeout(0.5):  # how the gevent pool applies soft_time_limit
        with timed.transaction() as conn:
            conn.execute("SELECT pg_sleep(2)")
except gevent.Timeout:
    timed_out = True
seen_free = []
for _ in range(10):  # while the other holder's body runs on
    seen_free.append(free_elsewhere(dsn, other.name))
    time.sleep(0.1)
report = {
    "timed_out": timed_out,
    "other_free_elsewhere": any(seen_free),
    "other_lost": other.lost_reason,
    "other_held": other.held(),
    "timed_held": timed.held(),
}
timed.release()
other.release()
report["free_after"] = free_elsewhere(dsn, other.name) and free_elsewhere(dsn, timed.name)
print(json.dumps(report))
"""


def test_a_timeout_cutting_one_holders_statement_leaves_another_holders_shared_lock_held(
    pg_dsn: str, run_id: str
) -> None:
    """gevent.Timeout inside lock.transaction(): the statement is cancelled, the session lives."""
    done = subprocess.run(
        [sys.executable, "-c", GEVENT_TIMEOUT_IN_TRANSACTION, pg_dsn, run_id],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report == {
        "timed_out": True,
        "other_free_elsewhere": False,
        "other_lost": None,
        "other_held": True,
        "timed_held": True,
        "free_after": True,
    }


@pytest.mark.parametrize("strategy", STRATEGIES)
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


def test_a_shared_holders_transaction_writes_only_its_own_guarded_rows(
    pg_dsn: str, run_id: str
) -> None:
    table = f"isolated_{run_id}"
    with psycopg.connect(pg_dsn, autocommit=True) as admin:
        admin.execute(f"CREATE TABLE {table} (tenant text, v int)")
    install_guard(pg_dsn, table, "t:{tenant}")
    try:
        mine = lock(pg_dsn, f"t:A{run_id}", strategy="shared", shared_sessions=1)
        other = lock(pg_dsn, f"t:B{run_id}", strategy="shared", shared_sessions=1)
        assert mine.acquire() and other.acquire()
        with pytest.raises(psycopg.Error, match=table), mine.transaction() as conn:
            conn.execute(f"INSERT INTO {table} VALUES (%s, 1)", (f"B{run_id}",))
        with mine.transaction() as conn:
            conn.execute(f"INSERT INTO {table} VALUES (%s, 2)", (f"A{run_id}",))
        mine.release()
        other.release()
        with psycopg.connect(pg_dsn, autocommit=True) as admin:
            rows = admin.execute(f"SELECT tenant, v FROM {table}").fetchall()
        assert rows == [(f"A{run_id}", 2)]
    finally:
        remove_guard(pg_dsn, table)
        with psycopg.connect(pg_dsn, autocommit=True) as admin:
            admin.execute(f"DROP TABLE {table}")


@pytest.mark.parametrize("strategy", STRATEGIES)
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


@pytest.mark.parametrize("strategy", ["reuse", "connect"])
def test_a_kept_libpq_connection_runs_nothing_on_the_next_holders_session(
    pg_dsn: str, run_id: str, strategy: str
) -> None:
    """A holder that keeps lock.connection.pgconn cannot free the next holder's lock."""
    first = lock(pg_dsn, f"t:A:{run_id}", strategy=strategy)
    assert first.acquire()
    kept = first.connection.pgconn
    first.release()
    second = lock(pg_dsn, f"t:B:{run_id}", strategy=strategy)
    assert second.acquire()
    try:
        result = kept.exec_(b"SELECT pg_advisory_unlock_all()")
        assert result.status != psycopg.pq.ExecStatus.TUPLES_OK
    except psycopg.Error:
        pass  # the connection it kept is closed
    assert not free_elsewhere(pg_dsn, f"t:B:{run_id}")
    assert second.held()
    second.release()


def test_a_session_whose_handle_was_only_used_through_psycopg_serves_the_next_holder(
    pg_dsn: str, run_id: str
) -> None:
    """Reading pgconn is what psycopg does for every statement: that alone keeps reuse."""
    with lock(pg_dsn, f"t:A:{run_id}") as first:
        with first.connection.cursor() as cursor:
            cursor.execute("SELECT 1")
        backend = first.connection.info.backend_pid
    with lock(pg_dsn, f"t:B:{run_id}") as second:
        assert second.connection.info.backend_pid == backend
