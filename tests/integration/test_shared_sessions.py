"""G1, G9 and G11 under pglock_strategy = "shared": many holders of a process on a few sessions.

Holders share at most pglock_shared_sessions sessions per process, yet never hold one
name twice (the process's claim registry says no where the re-entrant server would say
yes); a wait, a failed open, a dropped lock or a time limit leaves no claim behind;
a shared session's failure loses every lock on it at once and tells each holder;
writes go through lock.transaction(), whose end leaves the session clean for the next.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import psycopg
import pytest
from celery import Celery

from pglock_celery import (
    LockLost,
    LockTimeout,
    LockUnavailable,
    PglockError,
)
from pglock_celery.config import PglockConfig
from pglock_celery.lock import AdvisoryLock
from pglock_celery.sources import registry
from tests.apps import core
from tests.support.history import overlaps, read_history
from tests.support.locks import free_elsewhere, held_elsewhere, lock, terminate
from tests.support.services import wait_until
from tests.support.workers import Worker

pytestmark = pytest.mark.usefixtures("empty_cache")  # no idle session across tests


RESULT_TIMEOUT = 120
shared_lock = partial(lock, strategy="shared", check_interval=0.2)


def shared_backends(dsn: str, worker_pid: int) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name LIKE %s",
            (f"pglock-shared|{worker_pid}|%",),
        ).fetchone()
    return int(row[0]) if row else 0


@contextlib.contextmanager
def scratch_table(dsn: str, name: str) -> Iterator[str]:
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


# --- never one name twice in the process ------------------------------------------------------


def test_two_hundred_threads_hold_distinct_names_on_at_most_four_sessions(
    pg_dsn: str, run_id: str
) -> None:
    held = [shared_lock(pg_dsn, f"t:{run_id}:{n}") for n in range(200)]
    barrier = threading.Barrier(len(held) + 1)

    def hold(one: AdvisoryLock) -> None:
        assert one.acquire()
        barrier.wait(30)  # all held at once
        barrier.wait(30)
        one.release()

    threads = [threading.Thread(target=hold, args=(one,)) for one in held]
    for thread in threads:
        thread.start()
    barrier.wait(30)
    try:
        assert registry.shared_count() <= 4
        assert shared_backends(pg_dsn, os.getpid()) <= 4
        assert not free_elsewhere(pg_dsn, f"t:{run_id}:7")
    finally:
        barrier.wait(30)
        for thread in threads:
            thread.join(30)
    assert free_elsewhere(pg_dsn, f"t:{run_id}:7")


def test_threads_racing_on_one_name_under_shared_never_hold_it_together(
    pg_dsn: str, run_id: str
) -> None:
    """40 threads x 25 tries on one name, 2 shared sessions: never two holders."""
    name = f"race:{run_id}"
    inside = [0]
    peak = [0]
    count_lock = threading.Lock()
    errors: list[BaseException] = []
    start = threading.Barrier(40)

    def worker() -> None:
        try:
            start.wait(10)
            for _ in range(25):
                with shared_lock(pg_dsn, name, shared_sessions=2) as held:
                    if held.acquired:
                        with count_lock:
                            inside[0] += 1
                            peak[0] = max(peak[0], inside[0])
                        time.sleep(0.001)
                        with count_lock:
                            inside[0] -= 1
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(40)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert errors == []
    assert peak[0] == 1
    assert free_elsewhere(pg_dsn, name)


def test_a_second_holder_in_the_process_sees_the_name_held(pg_dsn: str, run_id: str) -> None:
    with shared_lock(pg_dsn, f"t:{run_id}", shared_sessions=1) as first:
        assert first.acquired
        with shared_lock(pg_dsn, f"t:{run_id}", shared_sessions=1) as second:
            assert not second.acquired  # same session, re-entrant: the registry says no
    with shared_lock(pg_dsn, f"t:{run_id}") as third:
        assert third.acquired


def test_a_waiting_holder_gets_the_name_once_the_first_lets_go(pg_dsn: str, run_id: str) -> None:
    first = shared_lock(pg_dsn, f"t:{run_id}")
    assert first.acquire()
    got: list[float] = []

    def waiter() -> None:
        with AdvisoryLock(
            f"t:{run_id}",
            config=PglockConfig(dsn=pg_dsn, strategy="shared"),
            wait=True,
            timeout=10,
        ) as second:
            got.append(time.monotonic())
            assert second.acquired

    thread = threading.Thread(target=waiter)
    thread.start()
    time.sleep(0.3)  # the scenario itself: the waiter waits while the first holds
    assert not got
    released = time.monotonic()
    first.release()
    thread.join(10)
    assert got and got[0] >= released


# --- no claim left behind -------------------------------------------------------------------


def test_a_shared_wait_that_times_out_leaves_the_name_takeable(pg_dsn: str, run_id: str) -> None:
    """A shared wait_lock timing out raises LockTimeout in time and leaks no claim."""
    name = f"wt:{run_id}"
    with held_elsewhere(pg_dsn, name) as elsewhere:
        started = time.monotonic()
        with pytest.raises(LockTimeout):
            shared_lock(pg_dsn, name, wait=True, timeout=0.3).acquire()
        assert time.monotonic() - started < 1.5
        elsewhere.execute("SELECT pg_advisory_unlock_all()")
    with shared_lock(pg_dsn, name) as again:
        assert again.acquired


def test_a_failed_shared_session_open_leaks_no_claim(pg_dsn: str, run_id: str) -> None:
    """When no shared session can be opened, the name is not left claimed in the process."""
    bad = pg_dsn.replace("port=5432", "port=1") if "port=5432" in pg_dsn else pg_dsn + " port=1"
    with pytest.raises(LockUnavailable):
        shared_lock(bad, f"c:{run_id}", connect_timeout=2).acquire()
    with shared_lock(pg_dsn, f"c:{run_id}") as again:  # not left claimed in this process
        assert again.acquired


def test_a_shared_lock_dropped_without_release_is_freed_and_unclaimed(
    pg_dsn: str, run_id: str
) -> None:
    """A shared lock dropped while held is unlocked and unclaimed by the scheduler."""
    name = f"drop:{run_id}"
    dropped = shared_lock(pg_dsn, name, shared_sessions=1)
    assert dropped.acquire()
    del dropped
    gc.collect()
    wait_until(
        lambda: free_elsewhere(pg_dsn, name),
        5,
        "the dropped lock to be unlocked",
    )
    with shared_lock(pg_dsn, name, shared_sessions=1) as again:  # and not left claimed here
        assert again.acquired
    with shared_lock(pg_dsn, name, shared_sessions=1) as again:
        assert again.acquired


# --- a shared session's failure -----------------------------------------------------------------


def test_a_failed_shared_session_loses_every_lock_on_it_at_once(pg_dsn: str, run_id: str) -> None:
    held = [shared_lock(pg_dsn, f"t:{run_id}:{n}", shared_sessions=1) for n in range(5)]
    for one in held:
        assert one.acquire()
    backend = held[0].backend_pid
    held[0].sleep(0.5)  # past one check interval: monitors run
    assert backend is not None and terminate(pg_dsn, backend)
    wait_until(lambda: all(one.lost_reason for one in held), 3, "every lock to be marked lost")
    for one in held:
        with pytest.raises(LockLost):
            one.release()
    with shared_lock(pg_dsn, f"t:{run_id}:0", shared_sessions=1) as again:  # a new session
        assert again.acquired


def test_loss_of_a_shared_session_with_600_holds_marks_every_hold_lost(
    pg_dsn: str, run_id: str
) -> None:
    """A shared session with 600 holds fails: held() is False, all 600 are lost."""
    held = [
        shared_lock(pg_dsn, f"r:{run_id}:{n}", shared_sessions=1, check_interval=60)
        for n in range(600)
    ]
    for one in held:
        assert one.acquire()
    try:
        backend = held[0].backend_pid
        assert backend is not None and terminate(pg_dsn, backend)
        time.sleep(0.2)  # the server ends the session
        assert held[0].held() is False
        assert [one.label for one in held if one.lost_reason is None] == []
    finally:
        for one in held:
            with contextlib.suppress(LockLost, RecursionError):
                one.release()


def test_a_dead_idle_shared_session_is_replaced_not_failing_the_next_lock(
    pg_dsn: str, run_id: str
) -> None:
    """A killed idle shared session is replaced: the next lock is taken, as under reuse."""
    with shared_lock(pg_dsn, f"d:{run_id}", shared_sessions=1) as first:
        backend = first.backend_pid
    assert backend is not None and terminate(pg_dsn, backend)
    time.sleep(0.2)
    with shared_lock(pg_dsn, f"d:{run_id}", shared_sessions=1) as again:
        assert again.acquired


# --- a shared session never runs a holder's SQL ------------------------------------------------


def test_a_shared_lock_refuses_connection_and_transaction_naming_the_strategies_that_fence(
    pg_dsn: str, run_id: str
) -> None:
    """lock.connection and lock.transaction() refuse under shared, with a PglockError that
    names the strategies giving fenced writes; the lock itself stays held."""
    with shared_lock(pg_dsn, f"t:{run_id}", shared_sessions=1) as held:
        for use in (lambda: held.connection, held.transaction):
            with pytest.raises(PglockError) as refused:
                use()
            assert "reuse" in str(refused.value) and "connect" in str(refused.value)
            assert not isinstance(refused.value, psycopg.Error)
        assert held.held()
        assert not free_elsewhere(pg_dsn, f"t:{run_id}")


def test_no_holder_on_a_shared_session_can_unlock_its_neighbours_lock(
    pg_dsn: str, run_id: str
) -> None:
    """Holder A's pg_advisory_unlock_all() and rollback cannot reach holder B's lock on
    the same session: A gets no SQL on it at all (before, B's lock was free on the server
    while B held it)."""
    with shared_lock(pg_dsn, f"b:{run_id}", shared_sessions=1) as neighbour:
        with shared_lock(pg_dsn, f"a:{run_id}", shared_sessions=1) as holder:
            assert holder.backend_pid == neighbour.backend_pid  # one session for both
            with pytest.raises(PglockError), holder.transaction() as conn:
                conn.execute("SELECT pg_advisory_unlock_all()")
                conn.execute("SELECT 1/0")
        assert not free_elsewhere(pg_dsn, f"b:{run_id}")
        assert neighbour.held()


def test_nesting_two_shared_locks_transactions_refuses_with_the_strategy_not_autocommit(
    pg_dsn: str, run_id: str
) -> None:
    """Two locks' nested transactions under shared: a PglockError naming the strategy,
    never psycopg's "can't change 'autocommit' now" about a setting nobody touched."""
    with (
        shared_lock(pg_dsn, f"o:{run_id}", shared_sessions=1) as outer,
        shared_lock(pg_dsn, f"i:{run_id}", shared_sessions=1) as inner,
    ):
        with pytest.raises(PglockError, match="shared"):
            with outer.transaction(), inner.transaction():
                pass
        assert outer.held() and inner.held()


def test_a_shared_session_runs_only_the_librarys_statements(pg_dsn: str, run_id: str) -> None:
    """Whatever its holders did, the last statement every shared session ran is ours."""
    held = [shared_lock(pg_dsn, f"q:{run_id}:{n}", shared_sessions=2) for n in range(6)]
    for one in held:
        assert one.acquire()
        with contextlib.suppress(PglockError):
            with one.transaction() as conn:
                conn.execute("SELECT 'a holder was here'")
    try:
        with psycopg.connect(pg_dsn, autocommit=True) as admin:
            queries = admin.execute(
                "SELECT query FROM pg_stat_activity WHERE application_name LIKE %s",
                (f"pglock-shared|{os.getpid()}|%",),
            ).fetchall()
        assert queries and all("advisory" in query for (query,) in queries), queries
    finally:
        for one in held:
            one.release()


# --- gevent: a hard time limit (gevent.Timeout) inside a lock statement -------------------------


def gevent_timeout(dsn: str, name: str, *args: str) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-m", "tests.support.gevent_timeout", dsn, name, *args],
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


def test_a_gevent_time_limit_in_one_holders_release_leaves_the_other_holders_locks_held(
    pg_dsn: str, run_id: str
) -> None:
    """gevent.Timeout in one holder's release: its statement is cancelled, its key let go,
    and the session's other holders keep their locks (no holder's timeout frees another's)."""
    report = gevent_timeout(pg_dsn, f"go:{run_id}", "release")
    assert report["other_lost"] is None and report["other_held"] is True
    assert report["free_elsewhere"] is True
    assert "other_release" not in report, report.get("other_release")


def test_a_shared_session_that_dies_after_an_interrupted_statement_is_seen_lost(
    pg_dsn: str, run_id: str
) -> None:
    """After a gevent.Timeout cut a lock statement, the session's death reaches held()."""
    report = gevent_timeout(pg_dsn, f"gk:{run_id}", "release", "--kill")
    assert report["other_held"] is False
    assert report["other_lost"] is not None


# --- a worker pool of hundreds -------------------------------------------------------------------


@pytest.fixture(
    scope="module", params=[("gevent", 500), ("threads", 50)], ids=["gevent", "threads"]
)
def shared_worker(
    request: pytest.FixtureRequest, app: Celery, worker_env: dict[str, str], log_dir: Path
) -> Iterator[Worker]:
    """One worker whose calls share lock sessions, on a queue of its own."""
    pool, concurrency = request.param
    env = {
        **worker_env,
        "PGLOCK_TEST_QUEUE": f"{worker_env['PGLOCK_TEST_QUEUE']}-shared-{pool}",
        "PGLOCK_STRATEGY": "shared",
    }
    worker = Worker(app, "tests.apps.core", env, log_dir, pool=pool, concurrency=concurrency)
    yield worker
    worker.stop()


def test_a_pool_of_hundreds_shares_four_sessions_and_never_overlaps(
    shared_worker: Worker, queue: str, history: str, pg_dsn: str, run_id: str
) -> None:
    pool = shared_worker.pool
    where = f"{queue}-shared-{pool}"
    calls = [
        core.step.apply_async((f"{run_id}-{n % 40}", history, 0.5), queue=where) for n in range(400)
    ]
    peak = 0
    deadline = time.monotonic() + RESULT_TIMEOUT
    while not all(call.ready() for call in calls) and time.monotonic() < deadline:
        peak = max(peak, shared_backends(pg_dsn, shared_worker.pid))
        time.sleep(0.1)  # a sampling period, not a synchronisation
    # Read from the stored results, not through get(): with hundreds of results at once
    # Celery's Redis result subscription can miss one and wait out its timeout
    # (celery/celery#4039) although the worker stored it.
    assert all(call.ready() for call in calls), "not every call ended in time"
    results = [call.result for call in calls]
    ran = [r for r in results if isinstance(r, dict) and r.get("ran")]
    skipped = [r for r in results if isinstance(r, dict) and r.get("skipped")]
    runs = read_history(pg_dsn, history)
    print(f"\n{pool} pool, shared: {len(ran)} ran, {len(skipped)} skipped, peak sessions {peak}")
    assert len(ran) + len(skipped) == 400 and ran and skipped
    assert {run.worker_pid for run in runs} == {shared_worker.pid}
    assert 1 <= peak <= 4
    assert overlaps(runs) == []
