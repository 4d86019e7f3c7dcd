"""G1, G2, G4 to G6 under injected faults, each test printing its figures.

Every run records (lock name, holder pid, session pid, start, end) with the
server clock, and a non-atomic read-sleep-write counter per tenant that must
equal the number of completed runs.
"""

from __future__ import annotations

import datetime as dt
import os
import signal
import time
from collections import Counter
from pathlib import Path

import psutil
import psycopg
import pytest
from celery.exceptions import TimeLimitExceeded, WorkerLostError
from celery.result import AsyncResult

from pglock_celery import LockLost, PglockError, lock_key, try_lock
from pglock_celery.inspect import find_holder
from tests.chaos.conftest import CHECK_INTERVAL, Chaos
from tests.support.history import Run, counters, overlaps, read_history
from tests.support.locks import terminate
from tests.support.orchestra import Orchestra
from tests.support.services import EmbeddedRedis, wait_until

UTC = dt.timezone.utc
#: The status pglock_on_lost = "terminate" ends a worker process with (README, Settings).
LOCK_LOST_EXIT_STATUS = 70


def started(dsn: str, table: str, name: str, count: int = 1) -> list[Run]:
    def runs() -> list[Run] | None:
        found = [r for r in read_history(dsn, table) if r.lock_name == name]
        return found if len(found) >= count else None

    return wait_until(runs, 30, f"{count} run(s) of {name} to start")


def server_now(dsn: str) -> dt.datetime:
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT clock_timestamp()").fetchone()
    assert row is not None
    return row[0]


def assert_consistent(
    dsn: str, table: str, ended: dict[int, dt.datetime] | None = None
) -> list[Run]:
    """0 overlaps (server clock) and counters equal to completed runs (no clock)."""
    ended = ended or {}
    runs = read_history(dsn, table)
    assert overlaps(runs, lambda run: ended.get(run.session_pid)) == []
    completed = Counter(run.lock_name for run in runs if run.finished is not None)
    assert counters(dsn, table) == dict(completed)
    return runs


def run_again(chaos: Chaos, tenant: str, table: str, timeout: float = 30) -> dict[str, object]:
    """Send quick steps for ``tenant`` until one runs (the others skip)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = chaos.send("chaos_step", tenant, table, 0).get(timeout=30)
        if result.get("ran"):
            return result  # type: ignore[no-any-return]
    raise AssertionError(f"{tenant} did not run again within {timeout} s")


def test_sigkill_of_the_holding_child_and_of_the_worker_main_process(
    chaos: Chaos, history: str, run_id: str
) -> None:
    first, second = chaos.worker(), chaos.worker()
    ended: dict[int, dt.datetime] = {}

    child_tenant = f"{run_id}-child"
    chaos.send("chaos_step", child_tenant, history, 10)
    run = started(chaos.dsn, history, f"tenant:{child_tenant}")[0]
    os.kill(run.worker_pid, signal.SIGKILL)
    ended[run.session_pid] = killed_at = server_now(chaos.dsn)
    run_again(chaos, child_tenant, history)
    again = max(r.started for r in read_history(chaos.dsn, history) if r.lock_name == run.lock_name)
    child_gap = (again - killed_at).total_seconds()

    main_tenant = f"{run_id}-main"
    chaos.send("chaos_step", main_tenant, history, 3)
    run = started(chaos.dsn, history, f"tenant:{main_tenant}")[0]
    owner = next(w for w in (first, second) if run.worker_pid in w.children())
    orphans = owner.children()
    os.kill(owner.pid, signal.SIGKILL)
    main_killed_at = server_now(chaos.dsn)
    try:
        # The orphaned child may finish its step; until its session ends, the lock holds.
        wait_until(lambda: not psutil.pid_exists(run.worker_pid) or _zombie(run.worker_pid),
                   30, "the orphaned child to end")  # fmt: skip
        ended[run.session_pid] = server_now(chaos.dsn)
        run_again(chaos, main_tenant, history)
    finally:
        for pid in orphans:
            if psutil.pid_exists(pid):
                os.kill(pid, signal.SIGKILL)
    again = max(r.started for r in read_history(chaos.dsn, history) if r.lock_name == run.lock_name)
    main_gap = (again - main_killed_at).total_seconds()
    runs = assert_consistent(chaos.dsn, history, ended)
    orphan_finished = any(r.finished for r in runs if r.session_pid == run.session_pid)
    print(
        f"\nchild SIGKILL: tenant ran again after {child_gap:.2f} s;"
        f" main SIGKILL: after {main_gap:.2f} s (orphaned child finished its step:"
        f" {orphan_finished}); {len(runs)} runs, 0 overlaps"
    )


def _zombie(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_a_paused_holder_keeps_its_tenant_and_finishes_after_sigcont(
    chaos: Chaos, history: str, run_id: str
) -> None:
    chaos.worker()
    chaos.worker()
    tenant = f"{run_id}-paused"
    step = chaos.send("chaos_step", tenant, history, 1)
    run = started(chaos.dsn, history, f"tenant:{tenant}")[0]
    os.kill(run.worker_pid, signal.SIGSTOP)
    paused_at = time.monotonic()
    try:
        skips = 0
        while time.monotonic() - paused_at < 3:  # longer than a scan interval
            result = chaos.send("chaos_step", tenant, history, 0).get(timeout=30)
            assert result.get("skipped"), f"ran while the holder was paused: {result}"
            skips += 1
        with psycopg.connect(chaos.dsn) as conn:
            holder = find_holder(conn, lock_key(f"tenant:{tenant}"))
            now = conn.execute("SELECT now()").fetchone()[0]  # type: ignore[index]
        assert holder is not None and holder.worker_pid == run.worker_pid
        age = (now - dt.datetime.fromisoformat(str(holder.backend_start))).total_seconds()
        assert age >= 3
    finally:
        os.kill(run.worker_pid, signal.SIGCONT)
    assert step.get(timeout=30)["ran"] is True
    runs = assert_consistent(chaos.dsn, history)
    print(f"\nSIGSTOP for 3 s: {skips} calls skipped meanwhile, lock age {age:.1f} s")
    print(f"after SIGCONT the step finished; {len(runs)} run(s), 0 overlaps")


def test_a_terminated_lock_session_is_noticed_and_its_writes_fail(
    chaos: Chaos, history: str, run_id: str
) -> None:
    chaos.worker()
    tenant = f"{run_id}-terminated"
    step = chaos.send("chaos_step", tenant, history, 10)
    run = started(chaos.dsn, history, f"tenant:{tenant}")[0]
    assert terminate(chaos.dsn, run.session_pid)
    terminated_at = time.monotonic()
    with pytest.raises(LockLost, match="was lost"):
        step.get(timeout=30)
    noticed = time.monotonic() - terminated_at
    print(f"\npg_terminate_backend: the step failed with LockLost after {noticed:.2f} s")
    assert noticed < CHECK_INTERVAL + 2
    # Its closing write (counter and end time) never committed.
    assert counters(chaos.dsn, history) == {}
    assert read_history(chaos.dsn, history)[0].finished is None
    assert "lock tenant:" in chaos.logs_text() and "lost by pglock|" in chaos.logs_text()


def test_on_lost_terminate_ends_the_process_with_70_and_the_message_runs_again(
    chaos: Chaos, history: str, run_id: str
) -> None:
    """The process exits with status 70; acks_late puts the message back, and it reruns."""
    worker = chaos.worker(concurrency=1, PGLOCK_ON_LOST="terminate")
    tenant = f"{run_id}-ended"
    step = chaos.send("chaos_step", tenant, history, 3)
    run = started(chaos.dsn, history, f"tenant:{tenant}")[0]
    assert terminate(chaos.dsn, run.session_pid)
    ended = {run.session_pid: server_now(chaos.dsn)}
    terminated_at = time.monotonic()
    wait_until(lambda: _zombie(run.worker_pid), CHECK_INTERVAL + 2, "the worker process to end")
    gone = time.monotonic() - terminated_at
    result = step.get(timeout=60)  # task_reject_on_worker_lost: redelivered, run again
    runs = assert_consistent(chaos.dsn, history, ended)
    log = worker.log.read_text(errors="replace")
    print(
        f"\non_lost=terminate: process {run.worker_pid} ended {gone:.2f} s after the terminate;"
        f" the redelivered message ran again: {result}"
    )
    assert "ending worker process" in log
    assert f"pid:{run.worker_pid} exited with 'exitcode {LOCK_LOST_EXIT_STATUS}'" in log
    assert result["ran"] is True and result["pid"] != run.worker_pid
    assert [r.finished is not None for r in sorted(runs, key=lambda r: r.started)] == [False, True]


@pytest.mark.parametrize("mode", ["fast", "immediate"])
def test_postgres_restart_mid_steps(chaos: Chaos, history: str, run_id: str, mode: str) -> None:
    chaos.worker()
    chaos.worker()
    tenants = [f"{run_id}-{n}" for n in range(4)]
    steps = [chaos.send("chaos_step", tenant, history, 10) for tenant in tenants]
    for tenant in tenants:
        started(chaos.dsn, history, f"tenant:{tenant}")
    chaos.pg.restart(mode)
    restarted_at = dt.datetime.now(UTC)
    began = time.monotonic()
    for step in steps:
        with pytest.raises(PglockError):
            step.get(timeout=30)
    detected = time.monotonic() - began
    ended = {run.session_pid: restarted_at for run in read_history(chaos.dsn, history)}
    for tenant in tenants:  # the system goes on by itself
        assert chaos.send("chaos_step", tenant, history, 0).get(timeout=60)["ran"] is True
    runs = assert_consistent(chaos.dsn, history, ended)
    print(
        f"\nPostgres restart ({mode}): all {len(steps)} holders failed with a lock error within"
        f" {detected:.2f} s of the restart; then {len(runs) - len(steps)} new runs, 0 overlaps"
    )


def test_hard_time_limit_inside_a_step_frees_the_lock(
    chaos: Chaos, history: str, run_id: str
) -> None:
    chaos.worker()
    tenant = f"{run_id}-stuck"
    with pytest.raises((TimeLimitExceeded, WorkerLostError)):
        chaos.send("stuck", tenant, history).get(timeout=30)
    started(chaos.dsn, history, f"tenant:{tenant}")
    with try_lock(f"tenant:{tenant}", dsn=chaos.dsn) as lock:
        assert lock.acquired
    with psycopg.connect(chaos.dsn) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name LIKE %s",
            (f"pglock|tenant:{tenant}|%",),
        ).fetchone()
    assert row == (0,)


def redeliver_while_running(chaos: Chaos, history: str, tenant: str) -> AsyncResult:
    """A 6 s step whose message comes back after 1 s (visibility timeout) and is ignored."""
    chaos.worker(PGLOCK_TEST_VISIBILITY_TIMEOUT="1")
    chaos.worker(PGLOCK_TEST_VISIBILITY_TIMEOUT="1")
    step = chaos.send("chaos_step", tenant, history, 6)
    started(chaos.dsn, history, f"tenant:{tenant}")
    wait_until(
        lambda: f"[{step.id}] itself: a redelivered copy, ignored" in chaos.logs_text(),
        30,
        "the redelivered copy to find its own first delivery holding the lock",
        0.2,
    )
    return step  # type: ignore[no-any-return]


def test_a_redelivered_copy_of_a_running_task_is_ignored_and_never_runs(
    chaos: Chaos, history: str, run_id: str
) -> None:
    """The copy finds its own task id holding the lock: it stores nothing, and one run."""
    tenant = f"{run_id}-redelivered"
    redeliver_while_running(chaos, history, tenant)
    name = f"tenant:{tenant}"
    wait_until(lambda: started(chaos.dsn, history, name)[0].finished, 30, "the run to end", 0.2)
    runs = assert_consistent(chaos.dsn, history)
    assert len(runs) == 1


def test_the_caller_of_a_redelivered_task_gets_its_runs_result(
    chaos: Chaos, history: str, run_id: str
) -> None:
    tenant = f"{run_id}-redelivered"
    step = redeliver_while_running(chaos, history, tenant)
    result = AsyncResult(step.id, app=chaos.app).get(timeout=30)
    assert result.get("ran") is True, f"the caller sees {result} for a call that ran"


def test_idle_session_timeout_on_the_server_does_not_cut_a_lock_session(
    chaos: Chaos, run_id: str
) -> None:
    with psycopg.connect(chaos.dsn, autocommit=True) as admin:
        admin.execute("ALTER SYSTEM SET idle_session_timeout = '1s'")
    plain: psycopg.Connection | None = None
    try:
        # The reload reaches new sessions once the postmaster has read it (its files
        # reachable: another pytest process may have closed its tmp root meanwhile): a
        # session that shows the timeout in force is the ordinary one the scenario needs.
        deadline = time.monotonic() + 30
        while True:
            chaos.pg.reload()
            plain = psycopg.connect(chaos.dsn, autocommit=True)
            shown = plain.execute("SHOW idle_session_timeout").fetchone()
            if shown == ("1s",):
                break
            plain.close()
            assert time.monotonic() < deadline, f"the reload never took: {shown}"
            time.sleep(0.05)
        with try_lock(f"idle:{run_id}", dsn=chaos.dsn) as lock:
            assert lock.acquired
            time.sleep(2.5)  # the scenario itself: idle for longer than the timeout
            assert lock.held()
            with pytest.raises(psycopg.OperationalError):
                plain.execute("SELECT 1")  # an ordinary session was cut off meanwhile
    finally:
        if plain is not None:
            plain.close()
        with psycopg.connect(chaos.dsn, autocommit=True) as admin:
            admin.execute("ALTER SYSTEM RESET idle_session_timeout")
        chaos.pg.reload()
    print("\nidle_session_timeout = 1s: the lock session stayed 2.5 s idle and kept its lock")


def test_redis_restart_without_persistence_loses_no_tenant(
    chaos: Chaos, log_dir: Path, tmp_path: Path
) -> None:
    broker = EmbeddedRedis(tmp_path / "redis")  # its own: the restart touches nothing else
    broker.start()
    orchestra = Orchestra(chaos.pg.dsn, broker.url, log_dir, None)
    try:
        orchestra.seed(4)
        orchestra.replicas(2)
        orchestra.beat()
        wait_until(lambda: min(orchestra.cycles().values()) >= 1, 90, "a first cycle each", 0.5)
        broker.stop()
        broker.start()
        before = orchestra.cycles()
        wait_until(
            lambda: all(c >= before[t] + 2 for t, c in orchestra.cycles().items()),
            120,
            "two more cycles for every tenant after the restart",
            0.5,
        )
        summary = orchestra.summary()
        print("\nRedis restarted (no persistence):\n" + "\n".join(summary.lines()))
        assert summary.overlaps == 0 and summary.duplicate_jobs == 0 and summary.stopped == 0
    finally:
        orchestra.close()
        broker.stop()
