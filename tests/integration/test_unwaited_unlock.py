"""Under strategy reuse a release sends its unlock and does not wait for it.

What that may change (when the server frees the lock, when a loss shown by the
unlock is reported) and what it may not (this process sees its own release at
once, a session found ended still fails the release, work handed on by a task
finds the lock free). A lock session's backend is paused with SIGSTOP to hold
the unlock unread for as long as a test needs.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from celery import Celery

from pglock_celery import TenantLockedTask, current_lock, monitor, sessions
from tests.helpers.services import wait_until
from tests.helpers.unwaited import free, lock, paused, warm


@pytest.fixture(autouse=True)
def empty_cache() -> Iterator[None]:
    sessions.close_idle()
    yield
    sessions.close_idle()


def backend_of(admin: psycopg.Connection[Any], name: str) -> int:
    """The backend of the session that holds ``name`` (found by its application_name)."""
    row = admin.execute(
        "SELECT pid FROM pg_stat_activity WHERE application_name LIKE %s",
        (f"%|{name}",),
    ).fetchone()
    assert row is not None, f"no session is named after {name}"
    return int(row[0])


def test_a_release_returns_before_the_server_read_its_unlock(
    pg_dsn: str, run_id: str, admin: psycopg.Connection[Any]
) -> None:
    name = f"a:{run_id}"
    warm(pg_dsn)
    held = lock(pg_dsn, name)
    assert held.acquire()
    with paused(backend_of(admin, name)) as resumed:
        held.release()
        returned_paused = not resumed.is_set()
        seen_held = not free(admin, name)
        assert not resumed.is_set(), "the test was too slow to see the paused state"
    assert returned_paused and seen_held
    wait_until(lambda: free(admin, name), 10, "the unlock to be read once the backend goes on")
    assert sessions.idle_count() == 1  # clean: back in the cache


def test_this_process_sees_its_own_release_at_once(
    pg_dsn: str, run_id: str, admin: psycopg.Connection[Any]
) -> None:
    first, second = f"a:{run_id}", f"b:{run_id}"
    warm(pg_dsn, 2)
    a, b = lock(pg_dsn, first), lock(pg_dsn, second)
    assert a.acquire() and b.acquire()
    with paused(backend_of(admin, first)) as resumed:
        a.release()
        b.release()  # its session goes back last: the next lock takes it
        again = lock(pg_dsn, first)
        got = again.acquire()
        # The try on b's session found the name held; it waited for a's unlock.
        assert resumed.is_set()
    assert got, "a lock this process released was seen held by its next try"
    again.release()


def test_a_loss_shown_by_the_unlock_is_reported_after_the_release(
    pg_dsn: str, run_id: str, caplog: pytest.LogCaptureFixture
) -> None:
    name = f"a:{run_id}"
    reports: list[str] = []
    held = lock(pg_dsn, name, task_id=f"task-{run_id}", on_lost=lambda _h, r: reports.append(r))
    before = monitor.losses["at_release"]
    warm(pg_dsn)
    assert held.acquire()
    session = held._session
    assert session is not None
    # Behind the library's back, on its own connection (no handle was given out,
    # so the release does not wait): the lock is gone before its release.
    session.conn.execute("SELECT pg_advisory_unlock_all()")
    with caplog.at_level(logging.ERROR, logger="pglock_celery.lock"):
        held.release()  # returns: the unlock's answer is read later
        wait_until(lambda: reports, 5, "the loss at release to be reported")
    assert reports == ["it was no longer held at release"]
    assert monitor.losses["at_release"] == before + 1
    [record] = [r for r in caplog.records if "lost before its release" in r.getMessage()]
    assert getattr(record, "task_id", None) == f"task-{run_id}"
    assert name in record.getMessage()
    wait_until(lambda: sessions.idle_count() == 0, 5, "the session to be closed, not kept")


@pytest.mark.parametrize("followed", [True, False], ids=["with a link", "alone"])
def test_a_step_with_work_to_follow_returns_only_once_its_lock_is_free(
    pg_dsn: str, run_id: str, admin: psycopg.Connection[Any], followed: bool
) -> None:
    app = Celery("unwaited", set_as_current=False, broker="memory://", backend="cache+memory://")
    app.conf.update(pglock_dsn=pg_dsn, task_store_eager_result=True)
    name = f"step:{run_id}"
    pauses: list[threading.Event] = []
    stack = contextlib.ExitStack()

    @app.task(base=TenantLockedTask, lock_name="step:{tenant}", shared=False)
    def step(tenant: str) -> str:
        pauses.append(stack.enter_context(paused(backend_of(admin, name))))
        return tenant

    @app.task(shared=False)
    def after(value: str) -> str:
        return value

    warm(pg_dsn)
    with stack:
        link = after.s() if followed else None
        result = step.apply((run_id,), link=link)
        assert result.get() == run_id
        [resumed] = pauses
        returned_paused = not resumed.is_set()
        free_at_return = free(admin, name)
    if followed:
        assert not returned_paused and free_at_return
    else:
        assert returned_paused and not free_at_return
    wait_until(lambda: free(admin, name), 10, "the lock to be free")


def test_a_loss_found_after_the_step_does_not_end_the_process(pg_dsn: str, run_id: str) -> None:
    """pglock_on_lost = terminate ends a process whose running step lost its lock; a loss
    found after the step returned has nothing left to stop (this very process would end)."""
    app = Celery("unwaited", set_as_current=False, broker="memory://", backend="cache+memory://")
    app.conf.update(pglock_dsn=pg_dsn, pglock_on_lost="terminate", task_store_eager_result=True)
    reports: list[str] = []

    @app.task(base=TenantLockedTask, lock_name="step:{tenant}", shared=False)
    def step(tenant: str) -> None:
        lock = current_lock()
        assert lock is not None and lock._session is not None and lock._hold is not None
        lock._hold.on_lost = lambda hold, reason: (reports.append(reason), real(hold, reason))
        lock._session.conn.execute("SELECT pg_advisory_unlock_all()")

    real = functools.partial(step._lock_lost, task_id=None, hostname=None, reaction="terminate")
    warm(pg_dsn)
    step.apply((run_id,)).get()
    wait_until(lambda: reports, 5, "the loss to be reported")
    assert reports == ["it was no longer held at release"]  # and this process lives on


EXITS_RIGHT_AFTER = """
import sys
from pglock_celery import sessions
from pglock_celery.config import PglockConfig
from pglock_celery.lock import AdvisoryLock

config = PglockConfig(dsn=sys.argv[1], strategy="reuse")
for _ in range(2):  # the unlock is prepared on the session's second one
    with AdvisoryLock(sys.argv[2] + ":warm", config=config):
        pass
lock = AdvisoryLock(sys.argv[2], config=config, task_id="last-task")
assert lock.acquire()
lock._session.conn.execute("SELECT pg_advisory_unlock_all()")
lock.release()
assert any(s.pending for stack in sessions._idle.values() for s in stack), "not unwaited"
"""


def test_a_process_that_exits_right_after_a_release_still_reports_its_loss(
    pg_dsn: str, run_id: str
) -> None:
    name = f"exit:{run_id}"
    done = subprocess.run(
        [sys.executable, "-c", EXITS_RIGHT_AFTER, pg_dsn, name],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert f"lock {name} was lost before its release" in done.stderr
    assert "(task last-task)" in done.stderr


def test_a_child_forked_while_an_unlock_is_unread_leaves_it_to_its_parent(
    pg_dsn: str, run_id: str, admin: psycopg.Connection[Any]
) -> None:
    """The child neither reads nor closes the parent's session with its unlock in flight;
    the parent reads it, and its session goes on serving the parent's next lock."""
    name = f"fork:{run_id}"
    warm(pg_dsn)
    held = lock(pg_dsn, name)
    assert held.acquire()
    session = held._session
    assert session is not None
    with paused(session.backend_pid):
        held.release()
        assert session.pending
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: reports what it sees, then leaves without cleanup
            os.close(read)
            seen = f"{sessions.idle_count()},{int(sessions.settle_pending())}"
            os.write(write, seen.encode())
            os._exit(0)
        os.close(write)
        seen = os.read(read, 16).decode()
        os.close(read)
        os.waitpid(pid, 0)
    assert seen == "0,0"  # no session of the parent's, nothing of its to read
    with lock(pg_dsn, name) as again:  # the same session, its unlock read first
        assert again.acquired and again._session is session
    wait_until(lambda: free(admin, name), 5, "the lock to be free")
