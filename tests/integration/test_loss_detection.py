"""G7 and G11, a loss is found in every state of the session: the monitor and its checks.

A lock session killed while idle, inside the body's transaction or during a statement,
a lock unlocked behind the holder's back, a second hold of one object, a session that
replaced a dead cached one: each loss is found within the detection bound, and the
body's next write fails. The checks never disturb a healthy body (its transactions,
prepared statements, pipelines, row factory, gevent) nor report a false loss.
"""

from __future__ import annotations

import contextlib
import select
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from celery import Celery
from psycopg.rows import dict_row

from pglock_celery import LockLost, TenantLockedTask, current_lock
from pglock_celery.config import PglockConfig
from pglock_celery.lock import AdvisoryLock
from pglock_celery.loss import LossKind
from tests.support import locks
from tests.support.locks import finish, free_elsewhere, lock, run_bounded, terminate
from tests.support.services import wait_until
from tests.support.workers import ROOT

pytestmark = pytest.mark.usefixtures("empty_cache")  # no idle session across tests


CHECK_INTERVAL = 0.2
DETECTION_BOUND = 1.25 * CHECK_INTERVAL + CHECK_INTERVAL + 0.5


@pytest.fixture
def eager_app(pg_dsn: str) -> Celery:
    return locks.eager_app(pg_dsn, "monitor", check_interval=CHECK_INTERVAL)


@pytest.fixture
def table(pg_dsn: str, run_id: str) -> Iterator[str]:
    name = f"monitor_{run_id}"
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(f"CREATE TABLE {name} (n int, at timestamptz DEFAULT clock_timestamp())")
    yield name
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(f"DROP TABLE {name}")


def backend_exists(dsn: str, pid: int) -> bool:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT count(*) FROM pg_stat_activity WHERE pid = %s", (pid,))
        return row.fetchone() == (1,)


def lost_within(held: AdvisoryLock, seconds: float) -> float:
    """Seconds until ``held.sleep`` raised LockLost; fails if it never did."""
    start = time.monotonic()
    with pytest.raises(LockLost):
        held.sleep(seconds)
    return time.monotonic() - start


def marked_lost_within(holder: AdvisoryLock, seconds: float) -> bool:
    """Whether ``holder`` is marked lost (lost_reason set) within ``seconds``."""
    deadline = time.monotonic() + seconds
    while holder.lost_reason is None and time.monotonic() < deadline:
        time.sleep(0.05)
    return holder.lost_reason is not None


# --- a loss in every state of the session ------------------------------------------------


def test_a_session_killed_while_idle_is_found_lost_by_the_monitor(pg_dsn: str, run_id: str) -> None:
    """Killed between statements, the monitor reports it; sleep() and release raise."""
    holder = lock(pg_dsn, f"idle:{run_id}", check_interval=0.2)
    assert holder.acquire()
    terminate(pg_dsn, holder.backend_pid)  # type: ignore[union-attr]
    assert marked_lost_within(holder, 2)
    with pytest.raises(LockLost):
        holder.sleep(0.1)
    with pytest.raises(LockLost):
        holder.release()


def test_a_session_killed_inside_the_bodys_transaction_is_found_lost(
    pg_dsn: str, run_id: str
) -> None:
    """Killed while idle in the body's transaction, the monitor reports it, no commit."""
    holder = lock(pg_dsn, f"intx:{run_id}", check_interval=0.2)
    assert holder.acquire()
    conn = holder.connection
    conn.autocommit = False
    conn.execute("SELECT 1")
    terminate(pg_dsn, conn.info.backend_pid)
    assert marked_lost_within(holder, 2)
    with pytest.raises(psycopg.Error):
        conn.commit()
    with pytest.raises(LockLost):
        holder.release()


def test_a_loss_inside_the_bodys_transaction_is_seen(pg_dsn: str, run_id: str) -> None:
    held = lock(pg_dsn, f"a:{run_id}", check_interval=CHECK_INTERVAL)
    with pytest.raises(LockLost), held:
        with pytest.raises(psycopg.OperationalError), held.connection.transaction():
            held.connection.execute("SELECT 1")
            assert terminate(pg_dsn, held.connection.info.backend_pid)
            took = lost_within(held, 5)
            print(f"\nloss inside a transaction seen after {took:.2f} s")
            assert took < 2


def test_a_session_killed_during_a_statement_fails_the_statement(pg_dsn: str, run_id: str) -> None:
    """Killed while a statement runs, the statement fails and held() says so."""
    holder = lock(pg_dsn, f"stmt:{run_id}", check_interval=0.2)
    assert holder.acquire()
    conn = holder.connection
    backend = conn.info.backend_pid
    _finished, _result = run_bounded(
        lambda: (time.sleep(0.3), terminate(pg_dsn, backend)), 0
    )  # kills it 0.3 s into the statement below
    with pytest.raises(psycopg.OperationalError):
        conn.execute("SELECT pg_sleep(3)")
    assert not holder.held()
    with pytest.raises(LockLost):
        holder.release()


def test_a_lock_unlocked_behind_the_holders_back_ends_the_session(pg_dsn: str, run_id: str) -> None:
    """The session alive without its lock is found and ended, so its writes fail."""
    holder = lock(pg_dsn, f"unl:{run_id}", check_interval=0.2)
    assert holder.acquire()
    conn = holder.connection
    conn.execute("SELECT pg_advisory_unlock_all()")  # a reset of the session, say
    assert marked_lost_within(holder, 2)
    time.sleep(0.2)
    with pytest.raises(psycopg.Error):
        conn.execute("SELECT 1")
    with pytest.raises(LockLost):
        holder.release()


def test_a_loss_is_found_while_the_body_keeps_its_connection_busy(
    eager_app: Celery, pg_dsn: str, table: str, run_id: str
) -> None:
    """Statements back to back never starve the monitor; the body's next write fails."""
    seen: dict[str, Any] = {}

    @eager_app.task(base=TenantLockedTask, lock_name="m:{tenant}", shared=False)
    def step(tenant: str) -> int:
        lock = current_lock()
        assert lock is not None
        conn = lock.connection
        seen["backend"] = conn.info.backend_pid
        seen["lock"] = lock
        time.sleep(1.5 * CHECK_INTERVAL)  # the monitor runs by now
        # Gone behind the holder's back, its session alive: only the monitor can tell.
        conn.execute("SELECT pg_advisory_unlock_all()")
        seen["unlocked"] = time.monotonic()
        writes = 0
        while time.monotonic() - seen["unlocked"] < 5:
            conn.execute(f"INSERT INTO {table} (n) VALUES (%s)", (writes,))
            writes += 1
            seen["writes"] = writes
        return writes

    result = step.apply((run_id,))
    failed_at = time.monotonic()
    assert isinstance(result.result, LockLost), result.result
    assert seen["lock"].loss is not None and seen["lock"].loss.kind is LossKind.LOCK_GONE
    took = failed_at - seen["unlocked"]
    print(f"\nloss found after {took:.2f} s while the body wrote {seen.get('writes')} rows")
    assert took < DETECTION_BOUND
    assert not backend_exists(pg_dsn, seen["backend"])


def test_once_the_monitor_finds_the_lock_gone_no_write_commits(
    eager_app: Celery, pg_dsn: str, table: str, run_id: str
) -> None:
    """The monitor ends the session it found without the lock; later writes fail.

    The body goes on after the loss (pglock_on_lost = raise) to show that its writes fail.
    """
    eager_app.conf.pglock_on_lost = "raise"
    seen: dict[str, Any] = {}

    @eager_app.task(base=TenantLockedTask, lock_name="m:{tenant}", shared=False)
    def step(tenant: str) -> None:
        lock = current_lock()
        assert lock is not None
        conn = lock.connection
        seen["backend"] = conn.info.backend_pid
        conn.execute("SELECT pg_advisory_unlock_all()")
        deadline = time.monotonic() + 10
        while lock.lost_reason is None and time.monotonic() < deadline:
            time.sleep(0.01)
        seen["reason"] = lock.lost_reason
        for attempt in range(3):
            try:
                with conn.transaction():
                    conn.execute(f"INSERT INTO {table} (n) VALUES (%s)", (attempt,))
            except psycopg.Error as exc:
                seen.setdefault("errors", []).append(type(exc).__name__)

    result = step.apply((run_id,))
    assert seen["reason"] == "the session no longer holds the lock"
    assert len(seen.get("errors", [])) == 3, seen
    assert isinstance(result.result, LockLost), result.result
    assert not backend_exists(pg_dsn, seen["backend"])
    with psycopg.connect(pg_dsn) as conn:
        assert conn.execute(f"SELECT count(*) FROM {table}").fetchone() == (0,)


# --- every hold is watched ----------------------------------------------------------------


def test_a_lock_on_a_session_that_replaced_a_dead_cached_one_is_monitored(
    pg_dsn: str, run_id: str
) -> None:
    with lock(pg_dsn, f"a:{run_id}", check_interval=CHECK_INTERVAL) as first:
        cached = first.connection.info.backend_pid
    assert terminate(pg_dsn, cached)  # a DBA ends the idle cached session
    held = lock(pg_dsn, f"b:{run_id}", check_interval=CHECK_INTERVAL)
    with pytest.raises(LockLost), held:
        assert held.connection.info.backend_pid != cached
        assert terminate(pg_dsn, held.connection.info.backend_pid)
        print(f"\nloss seen after {lost_within(held, 5):.2f} s")


def test_a_session_that_replaced_a_dead_cached_one_is_watched(pg_dsn: str, run_id: str) -> None:
    """The fresh session that replaced a dead cached one is monitored like any other."""
    warm = lock(pg_dsn, f"warm:{run_id}")
    assert warm.acquire()
    dead = warm.backend_pid
    warm.release()
    terminate(pg_dsn, dead)
    time.sleep(0.2)
    holder = lock(pg_dsn, f"repl:{run_id}", check_interval=0.2)
    assert holder.acquire()
    backend = holder.backend_pid
    assert backend != dead
    terminate(pg_dsn, backend)
    assert marked_lost_within(holder, 2)
    with contextlib.suppress(LockLost):
        holder.release()


def test_a_second_hold_of_one_lock_object_is_monitored(pg_dsn: str, run_id: str) -> None:
    held = lock(pg_dsn, f"a:{run_id}", check_interval=CHECK_INTERVAL)
    with held:
        pass
    with pytest.raises(LockLost), held:
        assert terminate(pg_dsn, held.connection.info.backend_pid)
        lost_within(held, 5)


def test_a_long_check_interval_elsewhere_never_delays_a_short_ones_monitor(
    pg_dsn: str, run_id: str
) -> None:
    slow = AdvisoryLock(f"slow:{run_id}", config=PglockConfig(dsn=pg_dsn, check_interval=60))
    fast = AdvisoryLock(f"fast:{run_id}", config=PglockConfig(dsn=pg_dsn, check_interval=0.2))
    with slow:
        time.sleep(0.5)  # the scheduler's next round is now a quarter of 60 s away
        with pytest.raises(LockLost), fast:
            assert terminate(pg_dsn, fast.connection.info.backend_pid)
            started = time.monotonic()
            with pytest.raises(LockLost):
                fast.sleep(5)
            assert time.monotonic() - started < DETECTION_BOUND


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
        assert fast.backend_pid is not None
        assert terminate(pg_dsn, fast.backend_pid)
        time.sleep(2.0)  # ten of fast's check intervals
        assert fast.lost_reason is not None
    finally:
        slow.release()
        with contextlib.suppress(LockLost):
            fast.release()


def test_alive_reads_the_socket_without_taking_what_libpq_is_owed(pg_dsn: str, run_id: str) -> None:
    """A notification waiting on the socket is life, and psycopg still gets it after.

    A test of session.py's Session.alive(), the monitor's check: it reaches the lock's
    session object itself.
    """
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
        assert terminate(pg_dsn, session.backend_pid)
        wait_until(lambda: not session.alive(), 5, "the session to read as dead")
        with pytest.raises(LockLost):
            held.release()
        assert not session.alive()  # closed now, and still dead


# --- the checks never disturb a healthy body -------------------------------------------------


def test_the_loss_check_never_runs_inside_the_bodys_transaction(pg_dsn: str, run_id: str) -> None:
    held = lock(pg_dsn, f"a:{run_id}", check_interval=0.001)
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # thread switches anywhere: the monitor may come in between
    try:
        with held:
            conn = held.connection
            deadline = time.monotonic() + 2
            rounds = 0
            while time.monotonic() < deadline and held.lost_reason is None:
                with pytest.raises(psycopg.errors.DivisionByZero):
                    conn.execute("BEGIN; SELECT 1/0")  # one statement call: idle to aborted
                conn.execute("ROLLBACK")
                time.sleep(0)  # the monitor may look at the idle session now
                rounds += 1
            assert held.lost_reason is None, f"after {rounds} rounds: {held.lost_reason}"
            assert held.held()
    finally:
        sys.setswitchinterval(switch)


def test_a_dict_row_factory_on_the_handle_harms_neither_release_nor_monitor(
    pg_dsn: str, run_id: str
) -> None:
    held = lock(pg_dsn, f"a:{run_id}", check_interval=CHECK_INTERVAL)
    with pytest.raises(LockLost), held:
        held.connection.row_factory = dict_row  # type: ignore[assignment]
        held.sleep(0.6)  # the monitor has checked a few times by now
        assert held.held()
        assert terminate(pg_dsn, held.connection.info.backend_pid)
        lost_within(held, 5)
    with lock(pg_dsn, f"a:{run_id}", check_interval=CHECK_INTERVAL) as again:
        pass
    assert not again.acquired


def test_a_long_body_can_repeat_a_query_after_the_monitor_ran(pg_dsn: str, run_id: str) -> None:
    """The monitor's checks must not break the holder's own prepared statements."""
    holder = lock(pg_dsn, f"prep2:{run_id}", strategy="connect", check_interval=0.1)
    assert holder.acquire()
    try:
        time.sleep(1.5)  # a dozen loss checks on the session
        assert holder.lost_reason is None
        for i in range(8):
            holder.connection.execute("SELECT %s::int", (i,))
    finally:
        finish(holder)


def test_a_body_repeating_a_query_gets_no_false_loss(pg_dsn: str, run_id: str) -> None:
    """A held lock whose holder prepared statements is not reported lost by the monitor."""
    holder = lock(pg_dsn, f"prep3:{run_id}", strategy="connect", check_interval=0.1)
    assert holder.acquire()
    try:
        for i in range(8):
            holder.connection.execute("SELECT %s::int", (i,))
        time.sleep(1.5)
        assert free_elsewhere(pg_dsn, holder.key) is False  # really still held
        assert holder.lost_reason is None, holder.lost_reason
    finally:
        finish(holder)


def _unstick(pg_dsn: str, holder: AdvisoryLock, backend: int) -> None:
    terminate(pg_dsn, backend)  # frees a thread stuck on the session
    time.sleep(0.3)
    finish(holder)


def test_ensure_held_inside_a_pipeline_returns(pg_dsn: str, run_id: str) -> None:
    """lock.ensure_held() called inside `with lock.connection.pipeline()` answers, never hangs."""
    holder = lock(pg_dsn, f"pipe:{run_id}")
    assert holder.acquire()
    conn = holder.connection
    backend = conn.info.backend_pid

    def body() -> str:
        with conn.pipeline():
            holder.ensure_held()
            conn.execute("SELECT 1")
        return "done"

    try:
        finished, result = run_bounded(body, 5)
        assert finished, "ensure_held() inside a pipeline hung for 5 s"
        assert result == "done", result
    finally:
        _unstick(pg_dsn, holder, backend)


def test_the_monitor_never_hangs_a_body_running_a_pipeline(pg_dsn: str, run_id: str) -> None:
    """A body batching writes in a pipeline for longer than the check interval finishes."""
    holder = lock(pg_dsn, f"pipe2:{run_id}", check_interval=0.2)
    assert holder.acquire()
    conn = holder.connection
    backend = conn.info.backend_pid

    def body() -> str:
        with conn.pipeline() as pipeline:
            for i in range(10):
                conn.execute("SELECT %s::int", (i,))
                pipeline.sync()
                time.sleep(0.2)  # the work between two writes of the batch
        return "done"

    try:
        finished, result = run_bounded(body, 10)
        assert finished, "the body hung: the monitor's check is stuck in the holder's pipeline"
        assert result == "done", result
    finally:
        _unstick(pg_dsn, holder, backend)


GREEN_TRANSACTION = """
from gevent import monkey
monkey.patch_all()
import sys
from pglock_celery.config import PglockConfig
from pglock_celery.lock import AdvisoryLock
held = AdvisoryLock("g:" + sys.argv[2], config=PglockConfig(dsn=sys.argv[1], check_interval=0.05))
with held, held.transaction() as conn:
    conn.execute("SELECT 1")
    held.sleep(0.5)  # the monitor peeks at the socket meanwhile, many times
    conn.execute("SELECT 1")
print("done", flush=True)
"""


def test_under_gevent_the_check_inside_a_transaction_never_blocks(pg_dsn: str, run_id: str) -> None:
    """gevent's socket would wait for data where the check only peeks: the body would hang."""
    done = subprocess.run(
        [sys.executable, "-c", GREEN_TRANSACTION, pg_dsn, run_id],
        capture_output=True, text=True, timeout=30, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0 and done.stdout.strip() == "done", done.stderr
