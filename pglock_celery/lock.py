"""The advisory lock: try or wait, held(), ensure_held(), release, loss detection.

Each lock has a session to itself from acquire to release: a new one
(strategy ``connect``) or one checked out of this process's idle lock
sessions (``reuse``, see sessions.py). Session-level advisory locks are
re-entrant within a session, so two holders sharing a session would both get
in; one holder per session rules that out.

While a lock is held past one check interval, a monitor thread checks its
session whenever the session is idle: alive, still holding the lock, on a
primary. A loss is logged, marks the lock lost (``ensure_held``, ``sleep`` and
release raise LockLost) and is handed to the holder's loss handler.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable
from contextvars import ContextVar
from types import TracebackType
from typing import Any

import psycopg
from celery import current_app
from celery._state import get_current_task
from psycopg import errors as pg_errors
from psycopg.pq import TransactionStatus

from . import sessions
from .config import PglockConfig, get_config
from .connection import application_name, idle_name, open_session
from .exceptions import LockLost, LockTimeout, LockUnavailable
from .inspect import Holder, find_holder
from .keys import check_key, key_to_lock_fields, lock_key

logger = logging.getLogger("pglock_celery.lock")

# Every lock statement also records the held key in the session setting pglock.held
# (",key,"), which guarded tables read instead of pg_locks (see guard.py).
HELD_SETTING = "pglock.held"
_TRY = (
    "SELECT got, CASE WHEN got THEN set_config('pglock.held', %s, false) END"
    " FROM pg_try_advisory_lock(%s::int8) AS got"
)
# A reused session takes the holder's name in the same round trip, only if it got the lock.
_TRY_AND_NAME = (
    "SELECT got, CASE WHEN got THEN set_config('application_name', %s, false)"
    " || set_config('pglock.held', %s, false) END"
    " FROM pg_try_advisory_lock(%s::int8) AS got"
)
# Back to the cache: no advisory lock of the holder's may stay, nor its name.
_UNLOCK_FOR_REUSE = (
    "SELECT pg_advisory_unlock(%s::int8), pg_advisory_unlock_all(),"
    " set_config('application_name', %s, false), set_config('pglock.held', '', false)"
)
_WAIT = "SELECT pg_advisory_lock(%s::int8)"
_UNLOCK = "SELECT pg_advisory_unlock(%s::int8)"
# One round trip: is the server a primary, and does this session hold the key?
_CHECK = """
SELECT pg_is_in_recovery(), EXISTS (
  SELECT FROM pg_locks
  WHERE locktype = 'advisory' AND granted AND objsubid = 1
    AND pid = pg_backend_pid()
    AND classid = %s::int8::oid AND objid = %s::int8::oid
    AND database = (SELECT oid FROM pg_database WHERE datname = current_database())
)
"""

#: Called from the monitor thread when a held lock is found lost.
LossHandler = Callable[["AdvisoryLock", str], None]

_current: ContextVar[AdvisoryLock | None] = ContextVar("pglock_current_lock", default=None)


def current_lock() -> AdvisoryLock | None:
    """Return the lock held by the task body running here, else None.

    Kept in a context variable: each thread, greenlet and process sees its own.
    """
    return _current.get()


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())


class AdvisoryLock:
    """A session-level Postgres advisory lock on a dedicated connection.

    Use it through :func:`try_lock` or :func:`wait_lock`. Not thread-safe:
    one lock belongs to one caller.
    """

    def __init__(
        self,
        name_or_key: str | int,
        *,
        config: PglockConfig,
        wait: bool = False,
        timeout: float | None = None,
        task_id: str | None = None,
        on_lost: LossHandler | None = None,
    ) -> None:
        if isinstance(name_or_key, str):
            self.name: str | None = name_or_key
            self.key: int = lock_key(name_or_key)
        else:
            self.name = None
            self.key = check_key(name_or_key)
        if timeout is not None and timeout < 0:
            raise ValueError(f"lock timeout must be >= 0 seconds, got {timeout}")
        self.acquired = False
        self._config = config
        self._wait = wait
        self._timeout = timeout
        self._task_id = task_id
        self._on_lost = on_lost
        self._conn: psycopg.Connection | None = None
        self._reuse = False
        self.application_name = ""
        self._lost: str | None = None
        self._lost_event = threading.Event()
        self._stop_monitor = threading.Event()

    @property
    def label(self) -> str:
        """The lock's name, or its key when it has none (for messages)."""
        return self.name if self.name is not None else f"#{self.key}"

    @property
    def connection(self) -> psycopg.Connection:
        """The lock's own autocommit connection, while the lock is held."""
        if self._conn is None or not self.acquired:
            raise LockLost(f"lock {self.label} is not held: it has no connection")
        return self._conn

    def __repr__(self) -> str:
        state = "held" if self.acquired else "not held"
        return f"<AdvisoryLock {self.label!r} key={self.key} {state}>"

    def acquire(self) -> bool:
        """Take the lock on a session of its own; return whether it is held.

        Raises LockUnavailable when no session can be opened or used, and
        LockTimeout when a waiting lock is not granted within its timeout.
        """
        if self._conn is not None:
            raise RuntimeError(f"lock {self.label} was already acquired once")
        self.application_name = application_name(
            self._config.application_name, self.label, self._task_id
        )
        self._reuse = self._config.strategy == sessions.REUSE
        cached = sessions.take(self._config) if self._reuse else None
        if cached is not None:
            try:
                self._lock_on(cached)
            except psycopg.Error:
                # An idle session that died or went wrong meanwhile: it held
                # nothing, so a fresh one may take its place.
                self._close()
            except BaseException:
                self._close()
                raise
        if self._conn is None:
            startup_name = idle_name(self._config.application_name) if self._reuse else None
            conn = open_session(self._config, startup_name or self.application_name)
            sessions.register(conn)
            try:
                self._lock_on(conn)
            except psycopg.Error as exc:
                self._close()
                raise LockUnavailable(
                    f"lock {self.label}: the lock session failed while locking: {_one_line(exc)}"
                ) from exc
            except BaseException:
                self._close()
                raise
        if self.acquired:
            _scheduler.watch(self)
        return self.acquired

    def _lock_on(self, conn: psycopg.Connection) -> None:
        """Take the lock on ``conn`` (a fresh or a cached session)."""
        self._conn = conn
        if self._wait:
            if self._reuse:
                conn.execute(
                    "SELECT set_config('application_name', %s, false)", (self.application_name,)
                )
            self._wait_for_lock()
            conn.execute("SELECT set_config('pglock.held', %s, false)", (self._held_value,))
            self.acquired = True
        elif self._reuse:
            row = conn.execute(
                _TRY_AND_NAME, (self.application_name, self._held_value, self.key)
            ).fetchone()
            self.acquired = bool(row and row[0])
        else:
            row = conn.execute(_TRY, (self._held_value, self.key)).fetchone()
            self.acquired = bool(row and row[0])

    @property
    def _held_value(self) -> str:
        return f",{self.key},"

    @property
    def lost_reason(self) -> str | None:
        """Why the lock was found lost while held, or None."""
        return self._lost

    def _start_monitor(self) -> None:
        """Check the session from now on, every check interval, until release."""
        if self._stop_monitor.is_set() or not self.acquired:
            return
        thread = threading.Thread(
            target=self._monitor, name=f"pglock-monitor {self.label}", daemon=True
        )
        thread.start()

    def _monitor(self) -> None:
        while self._lost is None and not self._stop_monitor.is_set():
            self._check_idle_session()
            if self._stop_monitor.wait(self._config.check_interval):
                return

    def _check_idle_session(self) -> None:
        """Check the session when nothing else uses it; a busy one reports its own errors."""
        conn = self._conn
        if conn is None or conn.lock.locked():
            return
        if conn.info.transaction_status != TransactionStatus.IDLE:
            return  # inside the body's transaction: its own statements will fail
        try:
            recovery, held = self._ask(conn)
        except psycopg.Error as exc:
            if self._stop_monitor.is_set():
                return  # released meanwhile: the session was closed on purpose
            self._mark_lost(f"the lock session failed: {_one_line(exc)}")
            return
        if recovery:
            self._mark_lost("the server is in recovery (a failover?)")
        elif not held:
            self._mark_lost("the session no longer holds the lock")

    def _ask(self, conn: psycopg.Connection) -> tuple[bool, bool]:
        row = conn.execute(_CHECK, key_to_lock_fields(self.key)).fetchone()
        assert row is not None
        return bool(row[0]), bool(row[1])

    def _mark_lost(self, reason: str) -> None:
        if self._lost is not None or self._stop_monitor.is_set():
            return
        self._lost = reason
        self._lost_event.set()
        logger.error(
            "lock %s lost by %s: %s",
            self.label,
            self.application_name,
            reason,
            extra={
                "lock": self.label,
                "key": self.key,
                "task_id": self._task_id,
                "holder": self.application_name,
                "reason": reason,
            },
        )
        conn = self._conn
        if conn is not None and not conn.closed and "session failed" not in reason:
            # Alive but without the lock (or on a standby): end the session, so
            # that no further write of this holder can commit.
            with contextlib.suppress(psycopg.Error):
                conn.execute("SELECT pg_terminate_backend(pg_backend_pid())")
        if self._on_lost is not None:
            self._on_lost(self, reason)

    def sleep(self, seconds: float) -> None:
        """Sleep, but raise LockLost as soon as the lock is found lost."""
        if not self.acquired:
            raise LockLost(f"lock {self.label} is not held")
        if self._lost_event.wait(seconds):
            raise LockLost(f"lock {self.label} was lost: {self._lost}")

    def _wait_for_lock(self) -> None:
        assert self._conn is not None
        if self._timeout is None:
            self._conn.execute(_WAIT, (self.key,))
            return
        # lock_timeout = 0 means "forever" to Postgres: wait at least 1 ms.
        millis = max(1, round(self._timeout * 1000))
        self._conn.execute("SELECT set_config('lock_timeout', %s, false)", (f"{millis}ms",))
        try:
            self._conn.execute(_WAIT, (self.key,))
        except pg_errors.LockNotAvailable:
            self._close()
            raise LockTimeout(
                f"lock {self.label} not obtained within {self._timeout:g} s"
            ) from None
        self._conn.execute("RESET lock_timeout")

    def holder(self) -> Holder | None:
        """Return who holds the lock now, asked on this lock's session."""
        if self._conn is None:
            return None
        try:
            return find_holder(self._conn, self.key)
        except psycopg.Error as exc:
            logger.warning(
                "lock %s: could not look up its holder: %s",
                self.label,
                _one_line(exc),
                extra={"lock": self.label, "key": self.key},
            )
            return None

    def held(self) -> bool:
        """Ask Postgres whether this session still holds the lock.

        A session that cannot be asked (closed, broken) holds nothing.
        """
        if self._conn is None or not self.acquired or self._lost or self._conn.closed:
            return False
        try:
            recovery, held = self._ask(self._conn)
        except psycopg.Error:
            return False
        return held and not recovery

    def ensure_held(self) -> None:
        """Raise LockLost unless Postgres confirms the lock is still held."""
        if self._lost is not None:
            raise LockLost(f"lock {self.label} was lost: {self._lost}")
        if not self.held():
            raise LockLost(f"lock {self.label} (key {self.key}) is no longer held")

    def release(self, reusable: bool = True) -> None:
        """Unlock and let the session go; idempotent.

        An open transaction is rolled back first: it was made under the lock and
        must not outlive it. Raises LockLost when the unlock shows the lock was
        already gone (false, or a failed session). A session goes back to this
        process's cache (strategy ``reuse``) only when ``reusable``, the unlock
        returned true and nothing else is in doubt; otherwise it is closed,
        which would free the lock anyway.
        """
        self._stop_monitor.set()
        _scheduler.unwatch(self)
        conn, self._conn = self._conn, None
        if conn is None:
            return
        was_held, self.acquired = self.acquired, False
        keep = False
        try:
            if not was_held:
                # Nothing was taken or renamed on this session.
                keep = self._reuse and reusable
                return
            keep = self._unlock(conn) and self._reuse and reusable
        finally:
            if not (keep and sessions.give_back(self._config, conn)):
                conn.close()

    def _unlock(self, conn: psycopg.Connection) -> bool:
        """Unlock; return whether the session may be used again, or raise LockLost."""
        clean = True
        try:
            if conn.info.transaction_status != TransactionStatus.IDLE:
                conn.rollback()
                clean = False
            if self._reuse:
                idle = idle_name(self._config.application_name)
                row = conn.execute(_UNLOCK_FOR_REUSE, (self.key, idle)).fetchone()
            else:
                row = conn.execute(_UNLOCK, (self.key,)).fetchone()
        except psycopg.Error as exc:
            raise LockLost(
                f"lock {self.label}: the session failed at release, so the lock "
                f"was lost before it: {_one_line(exc)}"
            ) from exc
        if not (row and row[0]):
            raise LockLost(f"lock {self.label} was no longer held at release")
        if self._lost is not None:
            raise LockLost(f"lock {self.label} was lost while held: {self._lost}")
        return clean

    def _close(self) -> None:
        self._stop_monitor.set()
        _scheduler.unwatch(self)
        conn, self._conn = self._conn, None
        self.acquired = False
        if conn is not None:
            conn.close()

    def __enter__(self) -> AdvisoryLock:
        self.acquire()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.finish(exc)

    def finish(self, error: BaseException | None) -> None:
        """Release after the guarded code ended, with ``error`` if it raised.

        A lost lock raises LockLost, unless ``error`` is already on its way:
        then the loss is logged and the caller sees its own exception.
        """
        try:
            # A session whose holder failed is not trusted again.
            self.release(reusable=error is None)
        except LockLost as lost:
            if error is None:
                raise
            logger.warning(
                "%s (while the body raised %s)",
                lost,
                type(error).__name__,
                extra={"lock": self.label, "key": self.key},
            )


class _MonitorScheduler:
    """Starts a held lock's monitor thread once it has been held one check interval.

    Most steps end sooner and never pay for a thread. One scheduler thread per
    process (started on first use, and again in a forked child) ticks every
    quarter interval while locks are held, so no thread switch is paid per lock;
    a lock's first check comes at most 1.25 intervals after it was taken.
    """

    #: Idle ticks before the thread sleeps until the next lock.
    IDLE_TICKS = 20

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._held: dict[int, tuple[float, AdvisoryLock]] = {}
        self._pid: int | None = None
        self._asleep = False
        self._tick = 0.5

    def watch(self, lock: AdvisoryLock) -> None:
        with self._cond:
            if self._pid != os.getpid():
                self._pid, self._held, self._asleep = os.getpid(), {}, False
                threading.Thread(target=self._run, name="pglock-monitors", daemon=True).start()
            self._held[id(lock)] = (time.monotonic(), lock)
            self._tick = lock._config.check_interval / 4
            if self._asleep:
                self._cond.notify()

    def unwatch(self, lock: AdvisoryLock) -> None:
        with self._cond:
            self._held.pop(id(lock), None)

    def _run(self) -> None:
        idle = 0
        while True:
            with self._cond:
                idle = 0 if self._held else idle + 1
                if idle > self.IDLE_TICKS:
                    self._asleep = True
                    self._cond.wait_for(lambda: bool(self._held))
                    self._asleep, idle = False, 0
                now = time.monotonic()
                due = [
                    lock
                    for since, lock in self._held.values()
                    if now - since >= lock._config.check_interval
                ]
                for lock in due:
                    del self._held[id(lock)]
                tick = self._tick
            for lock in due:
                lock._start_monitor()
            time.sleep(tick)


_scheduler = _MonitorScheduler()


def _config_for(dsn: str | None) -> PglockConfig:
    return get_config(current_app).with_dsn(dsn)


def _current_task_id() -> str | None:
    task: Any = get_current_task()
    return getattr(getattr(task, "request", None), "id", None) if task else None


def try_lock(name_or_key: str | int, *, dsn: str | None = None) -> AdvisoryLock:
    """Return a context manager that takes the lock if it is free, never waiting.

    ``lock.acquired`` tells whether it was taken. Without ``dsn``, the current
    Celery app's ``pglock_dsn`` is used, else ``PGLOCK_DSN``.
    """
    return AdvisoryLock(name_or_key, config=_config_for(dsn), task_id=_current_task_id())


def wait_lock(
    name_or_key: str | int, *, dsn: str | None = None, timeout: float | None = None
) -> AdvisoryLock:
    """Return a context manager that waits for the lock.

    Raises LockTimeout when it is not granted within ``timeout`` seconds
    (``None`` waits for as long as it takes).
    """
    return AdvisoryLock(
        name_or_key,
        config=_config_for(dsn),
        wait=True,
        timeout=timeout,
        task_id=_current_task_id(),
    )
