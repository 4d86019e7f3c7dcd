"""A process's lock sessions through random lives: the guarantees hold after every step.

Hypothesis drives acquire, release, bodies that change client and server state,
open transactions, handles kept past release, kills of idle and held sessions and
forks, under both strategies, on the real Postgres. After every step: no name is
held twice in the process, every hold is watched, a handed-out session is
pristine, and nothing is left after a release.
"""

from __future__ import annotations

import os
import time
import uuid
from typing import Any

import psycopg
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    rule,
)
from psycopg.rows import dict_row, tuple_row

from pglock_celery import LockLost, lock_key
from pglock_celery.config import PglockConfig
from pglock_celery.lock import AdvisoryLock
from pglock_celery.sources import registry
from tests.support.locks import free_elsewhere
from tests.support.services import wait_until

NAMES = ("a", "b", "c")
CHECK_INTERVAL = 0.05


class Entry:
    """One lock object of the machine, with what the model expects of it."""

    def __init__(self, lock: AdvisoryLock, name: str) -> None:
        self.lock = lock
        self.name = name
        self.killed = False
        self.handle: psycopg.Connection[Any] | None = None


class LockSessionLives(RuleBasedStateMachine):
    dsn: str = ""

    held = Bundle("held")

    def __init__(self) -> None:
        super().__init__()
        self.prefix = f"states-{uuid.uuid4().hex[:8]}"
        self.admin = psycopg.connect(self.dsn, autocommit=True)
        self.entries: list[Entry] = []
        self.kept_handles: list[tuple[psycopg.Connection[Any], str]] = []

    def _name(self, name: str) -> str:
        return f"{self.prefix}:{name}"

    def _holds(self, name: str) -> list[Entry]:
        """The entries holding ``name`` (a killed session's lock went with it)."""
        return [e for e in self.entries if e.name == name and e.lock.acquired and not e.killed]

    @initialize()
    def start_clean(self) -> None:
        registry.close()

    @rule(
        target=held,
        name=st.sampled_from(NAMES),
        strategy=st.sampled_from(["reuse", "connect"]),
        look=st.booleans(),
    )
    def acquire(self, name: str, strategy: str, look: bool) -> Entry:
        """Take a lock; with ``look``, check through a handle that its session is pristine
        (a holder with a handle is reset at release; one without has its unlock unwaited)."""
        config = PglockConfig(dsn=self.dsn, strategy=strategy, check_interval=CHECK_INTERVAL)
        lock = AdvisoryLock(self._name(name), config=config)
        busy = bool(self._holds(name))
        got = lock.acquire()
        if got is busy:
            who = self.admin.execute(
                "SELECT a.pid, a.application_name, a.state, a.query FROM pg_locks l"
                " JOIN pg_stat_activity a USING (pid) WHERE l.locktype = 'advisory'"
                " AND l.objid = %s::int8::oid",
                (lock_key(self._name(name)) & 0xFFFFFFFF,),
            ).fetchall()
            pytest.fail(f"{name}: acquired {got}, but the model says held {busy}: {who}")
        entry = Entry(lock, name)
        self.entries.append(entry)
        if lock.acquired and look:
            self._assert_pristine(lock)
        return entry

    def _assert_pristine(self, lock: AdvisoryLock) -> None:
        conn = lock.connection
        assert conn.autocommit and conn.row_factory is tuple_row and conn.read_only is None
        assert conn.prepare_threshold == 5 and conn.isolation_level is None
        row = conn.execute(
            "SELECT current_setting('statement_timeout'), current_setting('search_path'),"
            " to_regclass('pg_temp.scratch') IS NULL,"
            " (SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'"
            "  AND pid = pg_backend_pid())"
        ).fetchone()
        assert row == ("0", '"$user", public', True, 1), row

    @rule(entry=consumes(held))
    def release(self, entry: Entry) -> None:
        self.entries.remove(entry)
        was_held = entry.lock.acquired
        if was_held and entry.killed:
            with pytest.raises(LockLost):
                entry.lock.release()
        else:
            entry.lock.release()
        if entry.handle is not None:
            self.kept_handles.append((entry.handle, entry.name))
        if was_held and not self._holds(entry.name):
            # Free once the server read the unlock, which a release may not wait for.
            wait_until(lambda: self._free(entry.name), 5, f"{entry.name} to be free after release")

    @rule(entry=held, how=st.sampled_from(["autocommit", "rows", "prepare", "read_only"]))
    def change_client_state(self, entry: Entry, how: str) -> None:
        if not entry.lock.acquired or entry.killed:
            return
        conn = entry.lock.connection
        if conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
            return
        if how == "autocommit":
            conn.autocommit = False
            conn.execute("SELECT 1")
            conn.commit()
        elif how == "rows":
            conn.row_factory = dict_row  # type: ignore[assignment]
        elif how == "prepare":
            conn.prepare_threshold = 0
            conn.execute("SELECT %s::int", (1,))
        else:
            conn.read_only = True

    @rule(entry=held, what=st.sampled_from(["timeout", "path", "temp", "advisory", "begin"]))
    def change_server_state(self, entry: Entry, what: str) -> None:
        if not entry.lock.acquired or entry.killed:
            return
        conn = entry.lock.connection
        if conn.read_only or not conn.autocommit:
            return
        statements = {
            "timeout": "SET statement_timeout = 4321",
            "path": "SET search_path = nowhere",
            "temp": "CREATE TEMP TABLE IF NOT EXISTS scratch (v int)",
            "advisory": f"SELECT pg_try_advisory_lock({lock_key(self._name('stray'))})",
            "begin": "BEGIN",
        }
        conn.execute(statements[what])

    @rule(entry=held)
    def keep_the_handle(self, entry: Entry) -> None:
        if entry.lock.acquired and not entry.killed:
            entry.handle = entry.lock.connection

    @rule(entry=held)
    def kill_a_held_session(self, entry: Entry) -> None:
        backend = entry.lock.backend_pid
        if backend is None or entry.killed:
            return
        self.admin.execute("SELECT pg_terminate_backend(%s)", (backend,))
        entry.killed = True

    @rule()
    def kill_the_idle_sessions(self) -> None:
        pids = [
            s.backend_pid for source in registry.sources() for s in getattr(source, "_idle", [])
        ]
        for pid in pids:
            self.admin.execute("SELECT pg_terminate_backend(%s)", (pid,))

    @rule()
    def fork(self) -> None:
        child = os.fork()
        if child == 0:
            os._exit(0)
        _, status = os.waitpid(child, 0)
        assert status == 0

    def _free(self, name: str) -> bool:
        return free_elsewhere(self.admin, self._name(name))

    @invariant()
    def no_name_is_held_twice(self) -> None:
        for name in NAMES:
            holders = self._holds(name)
            assert len(holders) <= 1, f"{name} held by {len(holders)} objects"
            if holders:
                assert not self._free(name), f"{name} is free while a live hold has it"

    @invariant()
    def every_hold_is_watched(self) -> None:
        for entry in self.entries:
            hold = entry.lock._hold
            if hold is None or not hold.granted or entry.killed:
                continue

            def watched(hold: Any = hold) -> bool:
                return id(hold) in registry.monitor._holds

            deadline = time.monotonic() + 1
            while not watched() and time.monotonic() < deadline:
                time.sleep(0.005)
            assert watched(), f"{entry.name}: a hold nobody watches"

    @invariant()
    def kept_handles_are_dead(self) -> None:
        for handle, name in self.kept_handles:
            with pytest.raises(psycopg.OperationalError):
                handle.execute("SELECT 1")
            assert handle.closed, name

    @invariant()
    def idle_sessions_hold_nothing(self) -> None:
        pids = [
            s.backend_pid for source in registry.sources() for s in getattr(source, "_idle", [])
        ]
        if pids:
            row = self.admin.execute(
                "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = ANY(%s)",
                (pids,),
            ).fetchone()
            assert row == (0,), f"an idle session holds {row}"

    def teardown(self) -> None:
        for entry in self.entries:
            try:
                entry.lock.release()
            except LockLost:
                assert entry.killed
        registry.close()
        self.admin.execute("SELECT pg_advisory_unlock_all()")
        for name in NAMES:
            assert self._free(name), f"{name} is still held after the teardown"
        self.admin.close()


TestLockSessionLives = LockSessionLives.TestCase
TestLockSessionLives.settings = settings(
    max_examples=int(os.environ.get("PGLOCK_STATE_EXAMPLES", "40")),
    stateful_step_count=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


@pytest.fixture(autouse=True)
def machine_settings(pg_dsn: str) -> None:
    LockSessionLives.dsn = pg_dsn
