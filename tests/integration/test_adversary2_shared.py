"""Adversary 2: strategy shared, lock.transaction(), the claim registry, shared-session loss."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from pglock_celery import LockLost, lock_key
from pglock_celery.config import PglockConfig
from pglock_celery.lock import AdvisoryLock
from pglock_celery.sources import registry
from tests.adversary_helpers.bouncer import PGBOUNCER, pgbouncer
from tests.conftest import IN_CI


@pytest.fixture(autouse=True)
def no_shared_sessions_left() -> Iterator[None]:
    yield
    registry.close()


def lock(dsn: str, name: str, **config: Any) -> AdvisoryLock:
    settings: dict[str, Any] = {"dsn": dsn, "strategy": "shared", "check_interval": 0.2}
    settings.update(config)
    wait = settings.pop("wait", False)
    timeout = settings.pop("timeout", None)
    return AdvisoryLock(name, config=PglockConfig(**settings), wait=wait, timeout=timeout)


def free_elsewhere(dsn: str, name: str) -> bool:
    """Whether another session can take the lock now (it lets it go at once)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT pg_try_advisory_lock(%s)", (lock_key(name),)).fetchone()
        conn.execute("SELECT pg_advisory_unlock_all()")  # before the next statement of ours
    return bool(row and row[0])


@contextlib.contextmanager
def table(dsn: str, name: str) -> Iterator[str]:
    with psycopg.connect(dsn, autocommit=True) as admin:
        admin.execute(f"CREATE TABLE {name} (tenant text, v int)")
    try:
        yield name
    finally:
        with psycopg.connect(dsn, autocommit=True) as admin:
            admin.execute(f"DROP TABLE IF EXISTS {name}")


def rows(dsn: str, name: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return conn.execute(f"SELECT tenant, v FROM {name} ORDER BY v").fetchall()


def session_states(dsn: str) -> list[str]:
    """States of this process's shared lock sessions, as the server sees them."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        found = conn.execute(
            "SELECT state FROM pg_stat_activity WHERE application_name = %s",
            (f"pglock-shared|{os.getpid()}",),
        ).fetchall()
    return [state for (state,) in found]


# --- loss of a shared session with many holds -----------------------------------------


def test_loss_of_a_shared_session_with_600_holds_marks_every_hold_lost(
    pg_dsn: str, run_id: str
) -> None:
    """A shared session with 600 holds fails: held() is False, all 600 are lost."""
    held = [
        lock(pg_dsn, f"r:{run_id}:{n}", shared_sessions=1, check_interval=60) for n in range(600)
    ]
    for one in held:
        assert one.acquire()
    try:
        backend = held[0].backend_pid
        with psycopg.connect(pg_dsn, autocommit=True) as admin:
            admin.execute("SELECT pg_terminate_backend(%s)", (backend,))
        time.sleep(0.2)  # the server ends the session
        assert held[0].held() is False
        assert [one.label for one in held if one.lost_reason is None] == []
    finally:
        for one in held:
            with contextlib.suppress(LockLost, RecursionError):
                one.release()


# --- lock.transaction() under shared ------------------------------------------------------


def test_a_nested_lock_transaction_under_shared_commits_as_under_connect(
    pg_dsn: str, run_id: str
) -> None:
    """A nested lock.transaction() works under shared (as under connect) and leaks nothing."""
    with table(pg_dsn, f"adv2_nest_{run_id}") as name:
        with lock(pg_dsn, f"n:{run_id}", shared_sessions=1) as outer:
            with outer.transaction() as c1:
                c1.execute(f"INSERT INTO {name} VALUES ('outer', 1)")
                with outer.transaction() as c2:
                    c2.execute(f"INSERT INTO {name} VALUES ('inner', 2)")
        assert rows(pg_dsn, name) == [("outer", 1), ("inner", 2)]
        assert "idle in transaction" not in session_states(pg_dsn)


def test_a_write_in_a_shared_transaction_never_commits_after_the_lock_was_released(
    pg_dsn: str, run_id: str
) -> None:
    """Released inside its own transaction: the write never commits once the lock is free."""
    with table(pg_dsn, f"adv2_rel_{run_id}") as name:
        held = lock(pg_dsn, f"rel:{run_id}", shared_sessions=1)
        assert held.acquire()
        freed_before_commit = False
        with contextlib.suppress(psycopg.Error, LockLost):
            with held.transaction() as conn:
                conn.execute(f"INSERT INTO {name} VALUES ('late', 1)")
                with contextlib.suppress(LockLost):
                    held.release()
                freed_before_commit = free_elsewhere(pg_dsn, f"rel:{run_id}")
        committed = rows(pg_dsn, name)
        assert not (freed_before_commit and committed), (
            "the write committed after another session could take the lock"
        )


def test_session_authorization_set_in_one_holders_transaction_does_not_reach_the_next(
    pg_dsn: str, run_id: str
) -> None:
    """SET SESSION AUTHORIZATION in a shared transaction never reaches another holder."""
    role = f"adv2_role_{run_id}"
    with psycopg.connect(pg_dsn, autocommit=True) as admin:
        admin.execute(f"CREATE ROLE {role}")
    try:
        with lock(pg_dsn, f"a:{run_id}", shared_sessions=1) as first:
            with first.transaction() as conn:
                before = conn.execute("SELECT session_user").fetchone()
                conn.execute(f"SET SESSION AUTHORIZATION {role}")
        with lock(pg_dsn, f"b:{run_id}", shared_sessions=1) as second:
            with second.transaction() as conn:
                after = conn.execute("SELECT session_user").fetchone()
        assert after == before
    finally:
        registry.close()
        with psycopg.connect(pg_dsn, autocommit=True) as admin:
            admin.execute(f"DROP ROLE IF EXISTS {role}")


# --- a dead idle shared session --------------------------------------------------------


def test_a_dead_idle_shared_session_is_replaced_not_failing_the_next_lock(
    pg_dsn: str, run_id: str
) -> None:
    """A killed idle shared session is replaced: the next lock is taken, as under reuse."""
    with lock(pg_dsn, f"d:{run_id}", shared_sessions=1) as first:
        backend = first.backend_pid
    with psycopg.connect(pg_dsn, autocommit=True) as admin:
        admin.execute("SELECT pg_terminate_backend(%s)", (backend,))
    time.sleep(0.2)
    with lock(pg_dsn, f"d:{run_id}", shared_sessions=1) as again:
        assert again.acquired


# --- gevent: a hard time limit (gevent.Timeout) inside a lock statement ---------------


def gevent_timeout(dsn: str, name: str, *args: str) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-m", "tests.adversary2_helpers.gevent_timeout", dsn, name, *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    report: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["interrupted"], "the time limit never fired inside a lock statement"
    return report


def test_a_gevent_time_limit_while_a_shared_lock_is_taken_leaves_it_held_by_nobody(
    pg_dsn: str, run_id: str
) -> None:
    """gevent.Timeout inside a shared acquire: it raised, so no session keeps the lock (G6)."""
    report = gevent_timeout(pg_dsn, f"gt:{run_id}", "acquire")
    assert report["acquired"] is False
    assert report["free_elsewhere"] is True


def test_a_gevent_time_limit_while_a_shared_lock_is_released_leaves_the_name_takeable(
    pg_dsn: str, run_id: str
) -> None:
    """gevent.Timeout inside a shared release: the name can be taken again in this process."""
    report = gevent_timeout(pg_dsn, f"gr:{run_id}", "release")
    assert report["again"] is True


def test_a_gevent_time_limit_in_one_holder_tells_the_other_holders_on_the_session(
    pg_dsn: str, run_id: str
) -> None:
    """gevent.Timeout in one holder's release closes the session: its other holders know."""
    report = gevent_timeout(pg_dsn, f"go:{run_id}", "release")
    assert report["other_lost"] is not None and report["other_held"] is False
    assert "lost" in report["other_release"], report.get("other_release")


def test_a_shared_session_that_dies_after_an_interrupted_statement_is_seen_lost(
    pg_dsn: str, run_id: str
) -> None:
    """After a gevent.Timeout cut a lock statement, the session's death reaches held()."""
    report = gevent_timeout(pg_dsn, f"gk:{run_id}", "release", "--kill")
    assert report["other_held"] is False
    assert report["other_lost"] is not None


# --- fork while another thread has the shared session ------------------------------------


def test_a_child_forked_during_another_holders_transaction_can_leave_its_with_block(
    pg_dsn: str, run_id: str
) -> None:
    """A child forked during another thread's lock.transaction() can release its copy."""
    first = lock(pg_dsn, f"f:{run_id}:a", shared_sessions=1)
    second = lock(pg_dsn, f"f:{run_id}:b", shared_sessions=1)
    assert first.acquire() and second.acquire()
    inside, leave = threading.Event(), threading.Event()

    def in_transaction() -> None:
        with second.transaction() as conn:
            conn.execute("SELECT 1")
            inside.set()
            leave.wait(30)

    thread = threading.Thread(target=in_transaction)
    thread.start()
    try:
        assert inside.wait(10)
        pid = os.fork()
        if pid == 0:  # the child: leave the with block it inherited
            try:
                first.release()
            except BaseException as exc:
                print("child release raised", repr(exc), file=sys.stderr, flush=True)
            finally:
                os._exit(0)
        deadline = time.monotonic() + 5
        exited = False
        while time.monotonic() < deadline:
            done, _ = os.waitpid(pid, os.WNOHANG)
            if done:
                exited = True
                break
            time.sleep(0.05)
        else:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        assert exited, "the child hung in release() on the session guard a parent thread held"
    finally:
        leave.set()
        thread.join(10)
        second.release()
        first.release()


# --- G9: other holders' locks on the same shared session ----------------------------------


def _cycle_median(dsn: str, run_id: str, rounds: int = 200) -> float:
    times = []
    for n in range(rounds):
        one = lock(dsn, f"g9:{run_id}:probe:{n % 5}", shared_sessions=1, check_interval=3600)
        start = time.perf_counter()
        assert one.acquire()
        assert one.held()
        one.release()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def test_a_shared_transaction_behind_a_session_pooler_keeps_the_sessions_settings_and_locks(
    pg_dsn: str, run_id: str
) -> None:
    """Behind a session pooler, a shared transaction's reset keeps the token and settings."""
    if not shutil.which(PGBOUNCER):
        if IN_CI:
            pytest.fail("pgbouncer is not installed (make test installs it as root)")
        pytest.skip("no pgbouncer")
    with pgbouncer(pg_dsn, "session", pool_size=4) as dsn:
        first = lock(dsn, f"p:{run_id}:a", shared_sessions=1, pooler="session")
        assert first.acquire()
        try:
            with first.transaction() as conn:
                conn.execute("SELECT 1")
            with lock(dsn, f"p:{run_id}:b", shared_sessions=1, pooler="session") as second:
                assert second.acquired  # the token (pglock.session) survived the reset
            assert first.held()
            with first.transaction() as conn:  # the session's G3 settings still in force
                row = conn.execute("SHOW tcp_user_timeout").fetchone()
            assert row is not None and row[0] != "0"
        finally:
            with contextlib.suppress(LockLost):
                first.release()
            registry.close()


# --- the monitor scheduler: one long check interval stalls every hold's first check -------


def test_a_short_interval_hold_is_checked_in_time_after_a_long_interval_hold(
    pg_dsn: str, run_id: str
) -> None:
    """A hold with a 0.2 s interval finds its loss in ~1.25 intervals though a 60 s one exists."""
    slow = AdvisoryLock(f"slow:{run_id}", config=PglockConfig(dsn=pg_dsn, check_interval=60))
    assert slow.acquire()
    try:
        time.sleep(0.5)  # the scheduler thread picks up its tick (60 / 4 s)
        fast = AdvisoryLock(f"fast:{run_id}", config=PglockConfig(dsn=pg_dsn, check_interval=0.2))
        assert fast.acquire()
        with psycopg.connect(pg_dsn, autocommit=True) as admin:
            admin.execute(
                "SELECT pg_terminate_backend(%s)",
                (fast.backend_pid,),  # type: ignore[union-attr]
            )
        time.sleep(2.0)  # ten of fast's check intervals
        assert fast.lost_reason is not None
    finally:
        slow.release()
        with contextlib.suppress(LockLost):
            fast.release()
