"""Issue 12's findings, each a behaviour on a real Postgres that earlier code got wrong."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from celery import Celery
from psycopg.rows import dict_row, tuple_row

from pglock_celery import (
    ConfigurationError,
    LockLost,
    LockNameError,
    LockUnavailable,
    TenantLockedTask,
    current_lock,
    lock_key,
    try_lock,
    wait_lock,
)
from pglock_celery.config import PglockConfig
from pglock_celery.inspect import find_holder, list_holders
from pglock_celery.lock import AdvisoryLock
from pglock_celery.sources import registry
from tests.helpers.pgbouncer import pgbouncer
from tests.helpers.services import wait_until

ROOT = Path(__file__).resolve().parents[2]
#: A DSN nothing answers on: any test using it proves no connection was tried.
NOWHERE = "host=127.0.0.1 port=1 user=nobody dbname=none connect_timeout=2"


@pytest.fixture(autouse=True)
def empty_cache() -> Iterator[None]:
    registry.close()
    yield
    registry.close()


def lock(dsn: str, name: str, **config: Any) -> AdvisoryLock:
    settings: dict[str, Any] = {"dsn": dsn, "check_interval": 0.2, **config}
    return AdvisoryLock(name, config=PglockConfig(**settings))


def admin(dsn: str, query: str, params: tuple[Any, ...] = ()) -> Any:
    with psycopg.connect(dsn, autocommit=True) as conn:
        cursor = conn.execute(query, params)
        row = cursor.fetchone() if cursor.description else None
    return row[0] if row else None


def terminate(dsn: str, backend_pid: int) -> None:
    assert admin(dsn, "SELECT pg_terminate_backend(%s)", (backend_pid,))


def free_elsewhere(dsn: str, name: str) -> bool:
    """Whether another session could take ``name`` now (it lets go at once)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT pg_try_advisory_lock(%s)", (lock_key(name),)).fetchone()
        return bool(row and row[0])


def lost_within(held: AdvisoryLock, seconds: float) -> float:
    """Seconds until ``held.sleep`` raised LockLost; fails if it never did."""
    start = time.monotonic()
    with pytest.raises(LockLost):
        held.sleep(seconds)
    return time.monotonic() - start


@pytest.fixture
def table(pg_dsn: str, run_id: str) -> Iterator[str]:
    name = f"hardening_{run_id}"
    admin(pg_dsn, f"CREATE TABLE {name} (v int)")
    yield name
    admin(pg_dsn, f"DROP TABLE {name}")


# Finding 1 -------------------------------------------------------------------------------


def test_a_lock_on_a_session_that_replaced_a_dead_cached_one_is_monitored(
    pg_dsn: str, run_id: str
) -> None:
    with lock(pg_dsn, f"a:{run_id}") as first:
        cached = first.connection.info.backend_pid
    terminate(pg_dsn, cached)  # a DBA ends the idle cached session
    held = lock(pg_dsn, f"b:{run_id}")
    with pytest.raises(LockLost), held:
        assert held.connection.info.backend_pid != cached
        terminate(pg_dsn, held.connection.info.backend_pid)
        print(f"\nloss seen after {lost_within(held, 5):.2f} s")


def test_a_second_hold_of_one_lock_object_is_monitored(pg_dsn: str, run_id: str) -> None:
    held = lock(pg_dsn, f"a:{run_id}")
    with held:
        pass
    with pytest.raises(LockLost), held:
        terminate(pg_dsn, held.connection.info.backend_pid)
        lost_within(held, 5)


# Finding 2 and nested calls ---------------------------------------------------------------


@pytest.fixture
def eager_app(pg_dsn: str) -> Celery:
    app = Celery("hardening", set_as_current=False, broker="memory://", backend="cache+memory://")
    app.conf.update(pglock_dsn=pg_dsn, task_store_eager_result=True)
    return app


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


# Finding 3 -------------------------------------------------------------------------------


def _options_dropped(dsn: str, tmp_path: Path, mode: str) -> Iterator[str]:
    with pgbouncer(dsn, tmp_path, mode=mode, ignore_options=True) as through:
        yield through


@pytest.fixture
def transaction_pooler(pg_dsn: str, tmp_path: Path) -> Iterator[str]:
    yield from _options_dropped(pg_dsn, tmp_path, "transaction")


@pytest.fixture
def session_pooler(pg_dsn: str, tmp_path: Path) -> Iterator[str]:
    yield from _options_dropped(pg_dsn, tmp_path, "session")


@pytest.mark.parametrize("strategy", ["reuse", "connect"])
def test_behind_a_transaction_pooler_that_drops_options_no_body_runs(
    transaction_pooler: str, run_id: str, strategy: str
) -> None:
    for _ in range(3):
        with pytest.raises(LockUnavailable, match="pooler"):
            with lock(transaction_pooler, f"t:{run_id}", strategy=strategy):
                pytest.fail("the body ran on a session that is not a backend of its own")


def test_behind_a_session_pooler_without_the_setting_it_fails_closed(
    session_pooler: str, run_id: str
) -> None:
    with pytest.raises(LockUnavailable, match='pglock_pooler = "session"'):
        with lock(session_pooler, f"t:{run_id}"):
            pytest.fail("the body ran")


def test_a_declared_session_pooler_works_with_the_settings_in_force(
    session_pooler: str, pg_dsn: str, run_id: str
) -> None:
    with lock(session_pooler, f"t:{run_id}", pooler="session") as held:
        assert held.acquired and not free_elsewhere(pg_dsn, f"t:{run_id}")
        shown = held.connection.execute(
            "SELECT current_setting('tcp_user_timeout'), current_setting('idle_session_timeout')"
        ).fetchone()
        assert shown in (("12s", "0"), ("12000", "0"))  # shown from the socket: no unit
    assert free_elsewhere(pg_dsn, f"t:{run_id}")
    assert registry.idle_count() == 0  # a pooled session is never reused


# Findings 4, 5, 10: a reused session is pristine, handles die at release -------------------


def test_a_reused_session_comes_back_pristine_client_and_server_side(
    pg_dsn: str, run_id: str, table: str
) -> None:
    with lock(pg_dsn, f"a:{run_id}") as first:
        conn = first.connection
        backend = conn.info.backend_pid
        conn.execute("SET statement_timeout = 1234")
        conn.execute("SET search_path = nowhere")
        conn.execute("CREATE TEMP TABLE scratch (v int)")
        conn.execute("LISTEN somewhere")
        conn.autocommit = False
        conn.read_only = True
        conn.prepare_threshold = 0
        conn.row_factory = dict_row  # type: ignore[assignment]
        conn.execute("SELECT %s::int", (1,))
        conn.commit()
    assert registry.idle_count() == 1
    with lock(pg_dsn, f"b:{run_id}") as second:
        conn = second.connection
        assert conn.info.backend_pid == backend  # the very session, reused
        assert conn.autocommit and conn.read_only is None and conn.row_factory is tuple_row
        assert conn.prepare_threshold == 5
        assert conn.execute("SHOW statement_timeout").fetchone() == ("0",)
        assert conn.execute("SHOW search_path").fetchone() == ('"$user", public',)
        assert conn.execute("SELECT to_regclass('pg_temp.scratch')").fetchone() == (None,)
        assert conn.execute("SELECT count(*) FROM pg_listening_channels()").fetchone() == (0,)
        for _ in range(3):  # prepared statements start afresh on the server too
            conn.execute("SELECT %s::int", (1,), prepare=True)
        with conn.transaction():
            conn.execute(f"INSERT INTO public.{table} VALUES (1)")
    assert admin(pg_dsn, f"SELECT count(*) FROM {table}") == 1


@pytest.mark.parametrize("strategy", ["reuse", "connect"])
def test_a_handle_kept_past_release_cannot_write(
    pg_dsn: str, run_id: str, table: str, strategy: str
) -> None:
    with lock(pg_dsn, f"a:{run_id}", strategy=strategy) as first:
        kept = first.connection
        cursor = kept.cursor()
    with lock(pg_dsn, f"a:{run_id}", strategy=strategy) as second:
        assert second.acquired
        for write in (
            lambda: kept.execute(f"INSERT INTO {table} VALUES (1)"),
            lambda: cursor.execute(f"INSERT INTO {table} VALUES (1)"),
            lambda: kept.cursor().execute(f"INSERT INTO {table} VALUES (1)"),
        ):
            with pytest.raises(psycopg.OperationalError):
                write()
        assert kept.closed
    assert admin(pg_dsn, f"SELECT count(*) FROM {table}") == 0


def test_a_dict_row_factory_on_the_handle_harms_neither_release_nor_monitor(
    pg_dsn: str, run_id: str
) -> None:
    held = lock(pg_dsn, f"a:{run_id}")
    with pytest.raises(LockLost), held:
        held.connection.row_factory = dict_row  # type: ignore[assignment]
        held.sleep(0.6)  # the monitor has checked a few times by now
        assert held.held()
        terminate(pg_dsn, held.connection.info.backend_pid)
        lost_within(held, 5)
    with lock(pg_dsn, f"a:{run_id}") as again:
        pass
    assert not again.acquired


# Finding 7 and 8: fork ---------------------------------------------------------------------

FORK_KEEPS_NOTHING = """
import os, signal, sys, time
from pglock_celery.config import PglockConfig
from pglock_celery.lock import AdvisoryLock
config = PglockConfig(dsn=sys.argv[1])
with AdvisoryLock("warm:" + sys.argv[2], config=config):
    pass  # an idle session is cached now
child = os.fork()
if child == 0:
    time.sleep(60)
    os._exit(0)
held = AdvisoryLock("t:" + sys.argv[2], config=config)
held.acquire()
print(child, held.connection.info.backend_pid, flush=True)
time.sleep(60)
"""


def test_a_fork_never_keeps_a_killed_holders_lock_alive(pg_dsn: str, run_id: str) -> None:
    process = subprocess.Popen(
        [sys.executable, "-c", FORK_KEEPS_NOTHING, pg_dsn, run_id],
        stdout=subprocess.PIPE, text=True, cwd=ROOT,
    )  # fmt: skip
    assert process.stdout is not None
    child, _ = (int(field) for field in process.stdout.readline().split())
    try:
        assert not free_elsewhere(pg_dsn, f"t:{run_id}")
        process.kill()
        process.wait(10)
        start = time.monotonic()
        wait_until(lambda: free_elsewhere(pg_dsn, f"t:{run_id}"), 1.0, "the lock to come free")
        print(f"\nfree {1000 * (time.monotonic() - start):.0f} ms after the kill, child alive")
        os.kill(child, 0)  # the child still lives: it did not keep the lock
    finally:
        with __import__("contextlib").suppress(ProcessLookupError):
            os.kill(child, 9)
        process.kill()
        process.stdout.close()


FORK_RIGHT_AFTER_A_LOCK = """
import os, sys
from pglock_celery.config import PglockConfig
from pglock_celery.lock import AdvisoryLock
config = PglockConfig(dsn=sys.argv[1], check_interval=0.05)
held = AdvisoryLock("t:" + sys.argv[2], config=config)
held.acquire()
child = os.fork()
if child == 0:
    held.release()  # a child unwinding: sends nothing on its parent's session
    with AdvisoryLock("c:" + sys.argv[2], config=config) as mine:
        assert mine.acquired
    os._exit(0)
_, status = os.waitpid(child, 0)
print(status, held.held(), flush=True)
held.release()
"""


def test_a_child_forked_right_after_a_lock_neither_hangs_nor_touches_the_parents_session(
    pg_dsn: str, run_id: str
) -> None:
    for round_ in range(4):
        done = subprocess.run(
            [sys.executable, "-c", FORK_RIGHT_AFTER_A_LOCK, pg_dsn, f"{run_id}-{round_}"],
            capture_output=True, text=True, timeout=30, cwd=ROOT,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert done.stdout.split() == ["0", "True"], done.stderr


# Finding 9 and 14: loss inside the body's transaction; the check never lands in it ----------


def test_a_loss_inside_the_bodys_transaction_is_seen(pg_dsn: str, run_id: str) -> None:
    held = lock(pg_dsn, f"a:{run_id}")
    with pytest.raises(LockLost), held:
        with pytest.raises(psycopg.OperationalError), held.connection.transaction():
            held.connection.execute("SELECT 1")
            terminate(pg_dsn, held.connection.info.backend_pid)
            took = lost_within(held, 5)
            print(f"\nloss inside a transaction seen after {took:.2f} s")
            assert took < 2


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


# Finding 11 and bad input: clear errors before any connection -----------------------------


@pytest.mark.parametrize("name", ["", "a\x00b"])
def test_a_bad_name_is_refused_before_connecting(name: str) -> None:
    with pytest.raises(LockNameError):
        try_lock(name, dsn=NOWHERE)
    with pytest.raises(LockNameError):
        wait_lock(name, dsn=NOWHERE)


@pytest.mark.parametrize("timeout", [float("inf"), float("nan"), 1e10, -1])
def test_a_bad_timeout_is_refused_before_connecting(timeout: float) -> None:
    with pytest.raises(ValueError, match="lock timeout"):
        wait_lock("t", dsn=NOWHERE, timeout=timeout)


@pytest.mark.parametrize("timeout", [float("inf"), float("nan"), 1e10])
def test_a_bad_lock_timeout_option_is_a_configuration_error(
    eager_app: Celery, timeout: float
) -> None:
    eager_app.conf.pglock_dsn = NOWHERE

    @eager_app.task(base=TenantLockedTask, lock_mode="wait", lock_timeout=timeout, shared=False)
    def step(tenant_id: int) -> str:
        return "ran"

    with pytest.raises(ConfigurationError, match="lock_timeout"):
        step(1)


@pytest.mark.parametrize(
    ("template", "argument"), [("t:{tenant_id[0]}", 7), ("t:{tenant_id:d}", "x")]
)
def test_a_template_that_cannot_format_the_call_is_a_lock_name_error(
    eager_app: Celery, template: str, argument: Any
) -> None:
    eager_app.conf.pglock_dsn = NOWHERE

    @eager_app.task(base=TenantLockedTask, lock_name=template, shared=False)
    def step(tenant_id: Any) -> str:
        return "ran"

    with pytest.raises(LockNameError, match="cannot be formatted"):
        step(argument)


def test_a_nul_from_the_call_is_a_lock_name_error(eager_app: Celery) -> None:
    eager_app.conf.pglock_dsn = NOWHERE

    @eager_app.task(base=TenantLockedTask, shared=False)
    def step(tenant_id: Any) -> str:
        return "ran"

    with pytest.raises(LockNameError, match="NUL"):
        step("a\x00b")


# Finding 12 ------------------------------------------------------------------------------


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


# Finding 13 and the holder report ---------------------------------------------------------


@pytest.mark.parametrize(
    "name", ["租户:é", "line\nbreak", "tenant:" + str(uuid.uuid4()), "=odd", "租户" * 30]
)
def test_the_holder_of_any_name_is_reported_whole(pg_dsn: str, name: str) -> None:
    name = f"{name}:{uuid.uuid4().hex[:6]}"
    with lock(pg_dsn, name) as held, lock(pg_dsn, name) as skipped:
        assert held.acquired and not skipped.acquired
        holder = skipped.holder()
        assert holder is not None
        assert (holder.name, holder.worker_pid) == (name, os.getpid())
        assert holder.worker_host and holder.backend_pid == held.connection.info.backend_pid
        with psycopg.connect(pg_dsn, autocommit=True) as other:
            listed = [h for h in list_holders(other) if h.key == held.key]
            seen = find_holder(other, held.key)
        assert len(listed) == 1 and seen is not None and seen.worker_pid == os.getpid()
        if len(name.encode()) < 20:  # short enough to fit whole: listed by name too
            assert listed[0].name == name


# Lock objects: dropped without release, tried again ----------------------------------------


def test_a_held_lock_dropped_without_release_frees_its_lock(pg_dsn: str, run_id: str) -> None:
    held = lock(pg_dsn, f"a:{run_id}")
    assert held.acquire()
    held.sleep(0.5)  # past one check interval: its monitor is running
    assert not free_elsewhere(pg_dsn, f"a:{run_id}")
    del held
    gc.collect()
    wait_until(lambda: free_elsewhere(pg_dsn, f"a:{run_id}"), 2, "the dropped lock to go")


def test_one_lock_object_may_poll_until_it_gets_the_lock(pg_dsn: str, run_id: str) -> None:
    poller = lock(pg_dsn, f"a:{run_id}")
    with lock(pg_dsn, f"a:{run_id}") as holder:
        assert holder.acquired
        assert not poller.acquire()
        assert not poller.acquire()
    assert poller.acquire()
    with pytest.raises(RuntimeError, match="already held"):
        poller.acquire()
    poller.release()  # its unlock may not be waited for: free once the server reads it
    wait_until(lambda: free_elsewhere(pg_dsn, f"a:{run_id}"), 5, "the released lock to be free")


def test_a_session_serves_many_holders_that_use_their_handles(pg_dsn: str, run_id: str) -> None:
    backends = set()
    for round_ in range(12):  # past psycopg's prepare threshold, on both sides
        with lock(pg_dsn, f"a:{run_id}:{round_ % 2}") as held:
            for _ in range(6):
                held.connection.execute("SELECT %s::int", (round_,))
            backends.add(held.connection.info.backend_pid)
    assert len(backends) == 1


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
