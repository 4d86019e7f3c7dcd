"""TenantLockedTask's modes, skips, retries, nested calls and logs, on a real Postgres.

Calls run eagerly (``apply``) in this process: the lock, its session and the
server are real; only the broker is left out.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from celery import Celery
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from pglock_celery import (
    LockLost,
    LockTimeout,
    LockUnavailable,
    TenantLockedTask,
    current_lock,
    lock_key,
    try_lock,
)
from pglock_celery.config import PglockConfig
from pglock_celery.inspect import find_holder
from pglock_celery.keys import key_to_lock_fields
from pglock_celery.lock import AdvisoryLock
from tests.support import locks
from tests.support.locks import free_elsewhere, held_elsewhere, terminate
from tests.support.services import own_database, scalar

pytestmark = pytest.mark.usefixtures("empty_cache")  # no idle session across tests


@pytest.fixture
def eager_app(pg_dsn: str) -> Celery:
    return locks.eager_app(pg_dsn, "modes")


# A failed statement on a lost session ------------------------------------------------------


def test_a_statement_that_fails_on_a_lost_session_fails_the_call_with_lock_lost(
    eager_app: Celery, pg_dsn: str, run_id: str
) -> None:
    """With pglock_on_lost = raise, the body's failed statement on the lost session becomes
    LockLost (under the default, interrupt, the loss may reach the body first)."""
    eager_app.conf.pglock_on_lost = "raise"

    @eager_app.task(base=TenantLockedTask, lock_name="t:{tenant}", shared=False)
    def step(tenant: str) -> None:
        lock = current_lock()
        assert lock is not None
        assert terminate(pg_dsn, lock.connection.info.backend_pid)
        lock.connection.execute("SELECT 1")  # before any check could have seen the loss

    result = step.apply((run_id,))
    assert isinstance(result.result, LockLost), repr(result.result)
    assert str(result.result).startswith(
        f"task {step.name}: lock t:{run_id} was lost during the step:"
        " the lock session failed: it is closed. What to do: "
    )
    assert isinstance(result.result.__cause__, psycopg.OperationalError)
    assert "terminating connection" in str(result.result.__cause__)


# Retry mode running out of retries ---------------------------------------------------------


def test_retry_mode_fails_with_lock_timeout_once_its_retries_run_out(
    eager_app: Celery, pg_dsn: str, run_id: str
) -> None:
    ran: list[int] = []

    @eager_app.task(
        base=TenantLockedTask, lock_name="t:{tenant}", lock_mode="retry", max_retries=2,
        lock_retry_countdown=0.01, bind=True, shared=False,
    )  # fmt: skip
    def step(self: TenantLockedTask, tenant: str) -> None:
        ran.append(self.request.retries)

    other = held_elsewhere(pg_dsn, f"t:{run_id}")
    try:
        result = step.apply((run_id,))
    finally:
        other.close()
    assert isinstance(result.result, LockTimeout), repr(result.result)
    assert str(result.result) == (
        f"task {step.name}: lock t:{run_id} was still held after 2 retries"
    )
    assert ran == []


# What a skipping caller gets ----------------------------------------------------------------


def test_an_overridden_on_lock_skipped_gives_the_skip_result(
    eager_app: Celery, pg_dsn: str, run_id: str
) -> None:
    class Quiet(TenantLockedTask):
        def on_lock_skipped(self, lock_name, holder, args, kwargs):  # type: ignore[no-untyped-def]
            return {"busy": lock_name, "by": holder["backend_pid"], "args": list(args), **kwargs}

    @eager_app.task(base=Quiet, lock_name="t:{tenant}", shared=False)
    def step(tenant: str, stage: str = "x") -> str:
        return "ran"

    with try_lock(f"t:{run_id}", dsn=pg_dsn) as other:  # a holder that names its session
        assert other.acquired
        result = step.apply((run_id,), {"stage": "train"})
        holder = other.backend_pid
    assert result.successful()
    assert result.result == {
        "busy": f"t:{run_id}",
        "by": holder,
        "args": [run_id],
        "stage": "train",
    }


def test_without_report_holder_a_skip_names_no_holder(
    eager_app: Celery, pg_dsn: str, run_id: str
) -> None:
    eager_app.conf.pglock_report_holder = False

    @eager_app.task(base=TenantLockedTask, lock_name="t:{tenant}", shared=False)
    def step(tenant: str) -> str:
        return "ran"

    with try_lock(f"t:{run_id}", dsn=pg_dsn) as held:
        assert held.acquired
        result = step.apply((run_id,))
    assert result.result == {"skipped": True, "lock": f"t:{run_id}", "holder": None}
    eager_app.conf.pglock_report_holder = True
    with try_lock(f"t:{run_id}", dsn=pg_dsn) as held:
        result = step.apply((run_id,))
        assert result.result["holder"]["backend_pid"] == held.connection.info.backend_pid


# A task's own retry, and what is logged --------------------------------------------------


def test_a_tasks_own_retry_releases_its_lock_before_the_retry_is_sent(
    eager_app: Celery, pg_dsn: str, run_id: str
) -> None:
    seen: dict[str, Any] = {}

    @eager_app.task(base=TenantLockedTask, lock_name="t:{tenant}", bind=True, shared=False)
    def step(self: TenantLockedTask, tenant: str, stage: str = "first") -> str:
        if stage == "first":
            retry = self.retry((tenant, "second"), countdown=0, throw=False)
            seen["args"] = retry.sig.args
            seen["free"] = free_elsewhere(pg_dsn, f"t:{tenant}")
        return stage

    step.apply((run_id,))
    assert seen == {"args": (run_id, "second"), "free": True}


def test_an_inline_calls_retry_leaves_its_callers_hold_alone(
    eager_app: Celery, pg_dsn: str, run_id: str
) -> None:
    @eager_app.task(base=TenantLockedTask, lock_name="t:{tenant}", bind=True, shared=False)
    def inner(self: TenantLockedTask, tenant: str) -> None:
        self.retry(countdown=0, throw=False)

    @eager_app.task(base=TenantLockedTask, lock_name="t:{tenant}", shared=False)
    def outer(tenant: str) -> tuple[bool, bool]:
        retried = inner.apply((tenant,)).successful()  # runs under this call's hold
        lock = current_lock()
        held = lock is not None and lock.held() and not free_elsewhere(pg_dsn, f"t:{tenant}")
        return retried, held

    assert outer.apply((run_id,)).get() == (True, True)


def test_a_retry_after_the_lock_was_lost_logs_the_loss_and_still_retries(
    eager_app: Celery, pg_dsn: str, run_id: str, caplog: pytest.LogCaptureFixture
) -> None:
    seen: dict[str, Any] = {}

    @eager_app.task(base=TenantLockedTask, lock_name="t:{tenant}", bind=True, shared=False)
    def step(self: TenantLockedTask, tenant: str) -> None:
        lock = current_lock()
        assert lock is not None
        assert terminate(pg_dsn, lock.connection.info.backend_pid)
        seen["retry"] = self.retry(countdown=0, throw=False)
        seen["id"] = self.request.id

    step.apply((run_id,))
    assert seen["retry"] is not None
    [record] = [r for r in caplog.records if "before retrying" in r.getMessage()]
    assert record.levelname == "WARNING"
    assert record.getMessage().startswith(f"lock t:{run_id}: the session failed at release")
    assert record.getMessage().endswith(f"(before retrying task {step.name})")
    assert (record.lock, record.task_id) == (f"t:{run_id}", seen["id"])  # type: ignore[attr-defined]


@pytest.mark.parametrize("report", [True, False])
def test_a_skip_is_logged_with_its_holder_and_the_call(
    eager_app: Celery, pg_dsn: str, run_id: str, caplog: pytest.LogCaptureFixture, report: bool
) -> None:
    eager_app.conf.pglock_report_holder = report

    @eager_app.task(base=TenantLockedTask, lock_name="t:{tenant}", shared=False)
    def step(tenant: str) -> str:
        return "ran"

    holder_task = str(uuid.uuid4())
    held = AdvisoryLock(f"t:{run_id}", config=PglockConfig(dsn=pg_dsn), task_id=holder_task)
    with held, caplog.at_level("INFO"):
        assert held.acquired
        result = step.apply((run_id,))
        backend = held.connection.info.backend_pid
    [record] = [r for r in caplog.records if r.getMessage().endswith("skipped")]
    # The holder's task id whole, as in the result (grep finds one in the other).
    holder = (
        f"task {holder_task} (process {os.getpid()} on {socket.gethostname()}, backend {backend})"
        if report
        else "unknown"
    )
    assert record.getMessage() == (
        f"lock t:{run_id} is held by {holder}: task {step.name}[{result.id}] skipped"
    )
    assert (record.lock, record.task_id) == (f"t:{run_id}", result.id)  # type: ignore[attr-defined]
    # The log has every field of the holder; the result keeps the few a caller acts on.
    logged = record.holder  # type: ignore[attr-defined]
    kept = None if logged is None else {key: logged[key] for key in result.result["holder"]}
    assert kept == result.result["holder"]
    if report:
        assert result.result["holder"]["task_id"] == holder_task


def test_a_skip_names_a_holder_without_a_task_by_its_process(
    eager_app: Celery, pg_dsn: str, run_id: str, caplog: pytest.LogCaptureFixture
) -> None:
    @eager_app.task(base=TenantLockedTask, lock_name="t:{tenant}", shared=False)
    def step(tenant: str) -> str:
        return "ran"

    with try_lock(f"t:{run_id}", dsn=pg_dsn) as held, caplog.at_level("INFO"):
        step.apply((run_id,))
        backend = held.connection.info.backend_pid
    [record] = [r for r in caplog.records if r.getMessage().endswith("skipped")]
    assert record.getMessage().startswith(
        f"lock t:{run_id} is held by process {os.getpid()} on {socket.gethostname()}"
        f" (backend {backend}): "
    )


# The call's own options reach the lock -----------------------------------------------------


def test_keyword_arguments_reach_the_body_directly_and_under_a_callers_hold(
    eager_app: Celery, run_id: str
) -> None:
    @eager_app.task(base=TenantLockedTask, lock_name="t:{tenant}", shared=False)
    def inner(tenant: str, stage: str = "default") -> str:
        return stage

    @eager_app.task(base=TenantLockedTask, lock_name="t:{tenant}", shared=False)
    def outer(tenant: str, stage: str = "default") -> tuple[str, str]:
        return stage, inner(tenant, stage="inline")

    assert outer.apply((run_id,), {"stage": "given"}).get() == ("given", "inline")


def release_after(conn: psycopg.Connection[Any], seconds: float) -> threading.Thread:
    def release() -> None:
        time.sleep(seconds)
        conn.close()

    thread = threading.Thread(target=release)
    thread.start()
    return thread


@pytest.mark.parametrize(("timeout", "outcome"), [(0.3, "timeout"), (10, "ran")])
def test_wait_mode_waits_up_to_its_lock_timeout(
    eager_app: Celery, pg_dsn: str, run_id: str, timeout: float, outcome: str
) -> None:
    @eager_app.task(
        base=TenantLockedTask, lock_name="t:{tenant}", lock_mode="wait", lock_timeout=timeout,
        shared=False,
    )  # fmt: skip
    def step(tenant: str) -> str:
        return "ran"

    other = held_elsewhere(pg_dsn, f"t:{run_id}")
    thread = release_after(other, 1.0)
    started = time.monotonic()
    result = step.apply((run_id,))
    took = time.monotonic() - started
    thread.join()
    if outcome == "timeout":
        assert isinstance(result.result, LockTimeout), repr(result.result)
        assert took < 0.9
    else:
        assert result.result == "ran" and took >= 0.9


def test_the_holder_report_names_the_call_that_holds_the_lock(
    eager_app: Celery, pg_dsn: str, run_id: str
) -> None:
    @eager_app.task(base=TenantLockedTask, lock_name="t:{tenant}", shared=False)
    def step(tenant: str) -> Any:
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            holder = find_holder(conn, lock_key(f"t:{tenant}"))
        assert holder is not None
        return holder.task_id

    result = step.apply((run_id,))
    assert result.result == result.id


def test_autoretry_for_a_lock_error_retries_then_fails_with_it(
    eager_app: Celery, run_id: str
) -> None:
    eager_app.conf.pglock_dsn = "host=127.0.0.1 port=1 user=nobody dbname=none"
    retries: list[str] = []

    class Counting(TenantLockedTask):
        def on_retry(self, exc, task_id, args, kwargs, einfo):  # type: ignore[no-untyped-def]
            retries.append(type(exc).__name__)

    @eager_app.task(
        base=Counting, lock_name="t:{tenant}", autoretry_for=(LockUnavailable,),
        retry_kwargs={"countdown": 0, "max_retries": 2}, max_retries=5, shared=False,
    )  # fmt: skip
    def step(tenant: str) -> str:
        return "ran"

    result = step.apply((run_id,))
    assert isinstance(result.result, LockUnavailable), repr(result.result)
    assert "127.0.0.1:1" in str(result.result)
    assert retries == ["LockUnavailable", "LockUnavailable"]


def test_a_skip_drops_the_calls_callbacks_and_a_run_keeps_them(
    eager_app: Celery, pg_dsn: str, run_id: str
) -> None:
    eager_app.conf.task_always_eager = True  # callbacks are sent: run them here
    called: list[str] = []

    @eager_app.task(shared=False)
    def follow(label: str) -> None:
        called.append(label)

    @eager_app.task(base=TenantLockedTask, lock_name="t:{tenant}", shared=False)
    def step(tenant: str) -> str:
        return "ran"

    with try_lock(f"t:{run_id}", dsn=pg_dsn):
        assert step.apply((run_id,), link=follow.si("after a skip")).result["skipped"]
    assert step.apply((run_id,), link=follow.si("after a run")).result == "ran"
    assert called == ["after a run"]


def test_a_retry_while_held_is_logged_with_its_countdown(
    eager_app: Celery, pg_dsn: str, run_id: str, caplog: pytest.LogCaptureFixture
) -> None:
    @eager_app.task(
        base=TenantLockedTask, lock_name="t:{tenant}", lock_mode="retry", max_retries=1,
        lock_retry_countdown=0.25, shared=False,
    )  # fmt: skip
    def step(tenant: str) -> str:
        return "ran"

    holder_task = str(uuid.uuid4())
    held = AdvisoryLock(f"t:{run_id}", config=PglockConfig(dsn=pg_dsn), task_id=holder_task)
    with held, caplog.at_level("INFO"):
        result = step.apply((run_id,))
        backend = held.connection.info.backend_pid
    [record] = [r for r in caplog.records if "retries in" in r.getMessage()]
    shown = (
        f"task {holder_task} (process {os.getpid()} on {socket.gethostname()}, backend {backend})"
    )
    message = record.getMessage()
    assert message.startswith(
        f"lock t:{run_id} is held by {shown}: task {step.name}[{result.id}] retries in 0.25 s"
        " (at 20"
    ), message
    assert message.endswith("), retry 1 of 1 (0 left after it)"), message
    assert (record.lock, record.task_id) == (f"t:{run_id}", result.id)  # type: ignore[attr-defined]


def test_the_retry_countdown_falls_back_to_the_setting(
    eager_app: Celery, pg_dsn: str, run_id: str, caplog: pytest.LogCaptureFixture
) -> None:
    eager_app.conf.pglock_retry_countdown = 0.75

    @eager_app.task(
        base=TenantLockedTask, lock_name="t:{tenant}", lock_mode="retry", max_retries=1,
        shared=False,
    )  # fmt: skip
    def step(tenant: str) -> str:
        return "ran"

    with try_lock(f"t:{run_id}", dsn=pg_dsn), caplog.at_level("INFO"):
        step.apply((run_id,))
    assert any("] retries in 0.75 s (at " in r.getMessage() for r in caplog.records)


def test_on_lost_terminate_ends_the_process_with_status_70(
    eager_app: Celery, pg_dsn: str, run_id: str
) -> None:
    """Run in a forked child, which the reaction ends; the parent reads its status and log."""
    eager_app.conf.update(pglock_on_lost="terminate", pglock_check_interval=0.1)

    @eager_app.task(base=TenantLockedTask, lock_name="t:{tenant}", shared=False)
    def step(tenant: str, lose: bool = True) -> str:
        lock = current_lock()
        assert lock is not None
        if lose:
            lock.connection.execute("SELECT pg_advisory_unlock_all()")
            time.sleep(5)
        return "ran"

    assert step.apply((f"{run_id}-kept", False)).get() == "ran"  # the process lives on
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - the child
        os.close(read)
        handler = logging.StreamHandler(os.fdopen(write, "w"))
        logging.getLogger("pglock_celery").addHandler(handler)
        try:
            step.apply((run_id,), task_id=f"task-{run_id}")
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as logged:
        log = logged.read()
    _, status = os.waitpid(child, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 70, (status, log)
    assert f"so that task {step.name}[task-{run_id}] stops" in log


# An inline call of a task of another app: re-entrant only in the same database -------------


@pytest.fixture
def other_database(pg_server: str, pg_dsn: str) -> Iterator[str]:
    """A second database on the run's server: another app's lock database."""
    with own_database(pg_server) as dsn:
        assert conninfo_to_dict(dsn)["dbname"] != conninfo_to_dict(pg_dsn)["dbname"], (
            "no right to create a second database"
        )
        yield dsn


STRATEGIES = ["reuse", "connect", "shared"]


def app_on(dsn: str, strategy: str) -> Celery:
    return locks.eager_app(dsn, "elsewhere", strategy=strategy)


def key_holders(dsn: str, name: str) -> int:
    """How many sessions hold ``name``'s key in ``dsn``'s database."""
    classid, objid = key_to_lock_fields(lock_key(name))
    return int(
        scalar(
            dsn,
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted"
            " AND classid = %s AND objid = %s AND objsubid = 1"
            " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())",
            (classid, objid),
        )
    )


def nested_pair(outer_app: Celery, inner_dsn: str, strategy: str) -> tuple[Any, Any]:
    """A task on ``outer_app`` calling inline a task of an app on ``inner_dsn``, same lock
    name, both locking with ``strategy``."""
    tag = uuid.uuid4().hex[:8]
    outer_app.conf.pglock_strategy = strategy

    @app_on(inner_dsn, strategy).task(
        base=TenantLockedTask, lock_name="t:{tenant}", shared=False, name=f"inner-{tag}"
    )
    def inner(tenant: str) -> Any:
        lock = current_lock()
        assert lock is not None
        return {"lock": lock, "holders_here": key_holders(inner_dsn, f"t:{tenant}")}

    @outer_app.task(
        base=TenantLockedTask, lock_name="t:{tenant}", shared=False, name=f"outer-{tag}"
    )
    def outer(tenant: str) -> Any:
        answer = inner(tenant)
        if isinstance(answer, dict) and "holders_here" in answer:
            answer["under_caller"] = answer.pop("lock") is current_lock()
        return answer

    return inner, outer


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_an_inline_call_of_a_task_of_another_database_takes_its_lock_there(
    eager_app: Celery, pg_dsn: str, other_database: str, run_id: str, strategy: str
) -> None:
    _, outer = nested_pair(eager_app, other_database, strategy)
    assert outer.apply((run_id,)).get() == {"holders_here": 1, "under_caller": False}
    assert key_holders(other_database, f"t:{run_id}") == 0  # and released it


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_an_inline_call_of_a_task_of_another_database_skips_when_held_there(
    eager_app: Celery, pg_dsn: str, other_database: str, run_id: str, strategy: str
) -> None:
    _, outer = nested_pair(eager_app, other_database, strategy)
    other = held_elsewhere(other_database, f"t:{run_id}")
    try:
        answer = outer.apply((run_id,)).get()
    finally:
        other.close()
    assert answer["skipped"] is True and answer["lock"] == f"t:{run_id}"


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_an_inline_call_whose_dsn_spells_the_same_database_otherwise_runs_under_its_caller(
    eager_app: Celery, pg_dsn: str, run_id: str, strategy: str
) -> None:
    """Parameters in another order, as a URI, with other options: libpq's same target."""
    params = conninfo_to_dict(pg_dsn)
    uri = (
        f"postgresql://{params.get('user', '')}@{params['host']}:{params.get('port', 5432)}"
        f"/{params['dbname']}?connect_timeout=7&application_name=other"
    )
    if "password" in params:
        uri += f"&password={params['password']}"
    for spelling in (uri, make_conninfo("", **dict(reversed(list(params.items()))))):
        _, outer = nested_pair(eager_app, spelling, strategy)
        assert outer.apply((run_id,)).get() == {"holders_here": 1, "under_caller": True}


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_an_inline_call_whose_dsn_names_the_same_server_by_address_runs_under_its_caller(
    eager_app: Celery, pg_dsn: str, run_id: str, strategy: str
) -> None:
    """A server named by address in one DSN and by host name in the other cannot be told
    apart from the text: both servers are asked which database they serve."""
    params = conninfo_to_dict(pg_dsn)
    host = str(params.pop("host", ""))
    assert host and not host.startswith("/"), f"the test needs Postgres over TCP, not {host!r}"
    by_address = make_conninfo("", **params, hostaddr=socket.gethostbyname(host))
    _, outer = nested_pair(eager_app, by_address, strategy)
    assert outer.apply((run_id,)).get() == {"holders_here": 1, "under_caller": True}


def test_an_inline_call_that_cannot_ask_its_server_takes_its_own_lock_and_fails_closed(
    eager_app: Celery, run_id: str
) -> None:
    _, outer = nested_pair(eager_app, "host=127.0.0.1 port=1 dbname=none", "reuse")
    result = outer.apply((run_id,))
    assert isinstance(result.result, LockUnavailable), repr(result.result)


def test_a_skip_answers_a_frozen_callback_that_will_not_run(
    eager_app: Celery, pg_dsn: str, run_id: str
) -> None:
    @eager_app.task(shared=False)
    def follow(label: str) -> str:
        return label

    @eager_app.task(base=TenantLockedTask, lock_name="t:{tenant}", shared=False)
    def step(tenant: str) -> str:
        return "ran"

    callback = follow.si("after")
    callback.freeze()
    with try_lock(f"t:{run_id}", dsn=pg_dsn):
        skipped = step.apply((run_id,), link=callback).result
    assert skipped["skipped"] is True
    assert eager_app.AsyncResult(callback.id).get(timeout=5) == skipped


# Nested and inline calls, and the body's own errors -----------------------------------------


def test_a_nested_calls_retry_never_releases_its_callers_lock(
    eager_app: Celery, pg_dsn: str, run_id: str
) -> None:
    @eager_app.task(
        base=TenantLockedTask, lock_name="notify:{tenant}", lock_mode="retry", max_retries=1,
        lock_retry_countdown=0.01, shared=False,
    )  # fmt: skip
    def notify(tenant: str) -> str:
        return "notified"

    @eager_app.task(base=TenantLockedTask, lock_name="pipeline:{tenant}", shared=False)
    def advance(tenant: str) -> bool:
        notify.apply((tenant,))  # busy elsewhere: it retries, then gives up
        outer = current_lock()
        assert outer is not None
        return outer.held() and not free_elsewhere(pg_dsn, f"pipeline:{tenant}")

    with psycopg.connect(pg_dsn, autocommit=True) as other:
        other.execute("SELECT pg_advisory_lock(%s)", (lock_key(f"notify:{run_id}"),))
        assert advance.apply((run_id,)).get() is True


def test_an_inline_call_of_a_same_lock_task_runs_under_the_callers_hold(
    eager_app: Celery, run_id: str
) -> None:
    @eager_app.task(base=TenantLockedTask, lock_name="pipeline:{tenant}", shared=False)
    def step(tenant: str) -> Any:
        return "ran"

    @eager_app.task(base=TenantLockedTask, lock_name="pipeline:{tenant}", shared=False)
    def advance(tenant: str) -> Any:
        return step(tenant), step.apply((tenant,)).get(), current_lock() is not None

    assert advance.apply((run_id,)).get() == ("ran", "ran", True)


def test_other_threads_still_exclude_while_a_body_holds_the_lock(
    eager_app: Celery, run_id: str
) -> None:
    @eager_app.task(base=TenantLockedTask, lock_name="pipeline:{tenant}", shared=False)
    def step(tenant: str) -> Any:
        return "ran"

    @eager_app.task(base=TenantLockedTask, lock_name="pipeline:{tenant}", shared=False)
    def advance(tenant: str) -> Any:
        seen: list[Any] = []
        thread = threading.Thread(target=lambda: seen.append(step.apply((tenant,)).get()))
        thread.start()
        thread.join(10)
        return seen[0]

    assert advance.apply((run_id,)).get()["skipped"] is True


@pytest.mark.parametrize("copied", ["asyncio.to_thread", "executor with copy_context"])
def test_a_thread_given_a_copy_of_the_bodys_context_still_excludes(
    eager_app: Celery, run_id: str, copied: str
) -> None:
    """A context copied into another thread carries current_lock(), but that thread is
    not the body: its call of the same-lock task skips instead of running inline."""

    @eager_app.task(base=TenantLockedTask, lock_name="pipeline:{tenant}", shared=False)
    def step(tenant: str) -> Any:
        return "ran"

    def call_in_a_copied_context(tenant: str) -> Any:
        if copied == "asyncio.to_thread":
            return asyncio.run(asyncio.to_thread(lambda: step.apply((tenant,)).get()))
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            context = contextvars.copy_context()
            return pool.submit(context.run, lambda: step.apply((tenant,)).get()).result(10)

    @eager_app.task(base=TenantLockedTask, lock_name="pipeline:{tenant}", shared=False)
    def advance(tenant: str) -> Any:
        return call_in_a_copied_context(tenant)

    result = advance.apply((run_id,)).get()
    assert isinstance(result, dict) and result["skipped"] is True, result


def test_an_sql_error_in_the_bodys_transaction_is_the_bodys_own(
    eager_app: Celery, run_id: str
) -> None:
    @eager_app.task(base=TenantLockedTask, lock_name="t:{tenant}", shared=False)
    def step(tenant: str) -> None:
        held = current_lock()
        assert held is not None
        held.connection.execute("BEGIN")
        held.connection.execute("SELECT 1/0")

    result = step.apply((run_id,))
    assert isinstance(result.result, psycopg.errors.DivisionByZero), result.result
