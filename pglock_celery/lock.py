"""The advisory lock: try or wait, held(), ensure_held(), release.

Each granted acquire is a *hold* (monitor.py), the lock's session from grant
to release, watched for loss. A hold has its session to itself (strategy
``connect`` opens one, ``reuse`` checks one out of this process's idle
sessions, see sessions.py): session-level advisory locks are re-entrant within
a session, so two holders on one session would both get in. Every lock
statement proves that it ran on the session's own backend, so a session moved
by a pooler fails closed instead of locking elsewhere.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import weakref
from collections.abc import Iterator
from contextvars import ContextVar
from types import TracebackType
from typing import Any

import psycopg
from celery import current_app
from celery._state import get_current_task
from psycopg import errors as pg_errors
from psycopg.pq import TransactionStatus

from . import sessions, shared
from .config import PglockConfig, get_config
from .connection import application_name, idle_name, open_session
from .exceptions import LockLost, LockNameError, LockTimeout, LockUnavailable, PglockError
from .inspect import NAMED_HOLDER, Holder, named_holder, named_holder_params
from .keys import check_key, lock_key
from .lock_session import LockSession
from .monitor import Hold, LossHandler, abandoned, free_abandoned, one_line, scheduler

logger = logging.getLogger("pglock_celery.lock")

#: The session setting where a lock session records the keys it holds, as
#: ``,key,``; guarded tables read it instead of pg_locks (see guard.py).
HELD_SETTING = "pglock.held"

# A held lock is taken twice (its count is 2), so that a check can unlock it once
# and take it again without letting it go: "still held" in O(1), never from pg_locks.
# Statements are bytes for libpq, prepared per session under these names.

# Tries the lock only on the session's own backend (its token in force) holding
# nothing of an earlier holder's (NULL otherwise: a pooler moved it); if it got it,
# takes it a second time, names the session after its holder and records the key.
_TRY = (
    b"pglock_try",
    b"SELECT got, pg_backend_pid(), CASE WHEN got THEN"
    b" set_config('application_name', $1, false) || set_config('pglock.held', $2, false)"
    b" || pg_try_advisory_lock($4::int8)::text END"
    b" FROM (SELECT CASE WHEN current_setting('pglock.session', true) = $3"
    b" AND coalesce(current_setting('pglock.held', true), '') = ''"
    b" THEN pg_try_advisory_lock($4::int8) END AS got) AS attempt",
)
# The same proof before waiting: '' once granted, NULL when not on its own backend.
_WAIT = (
    b"pglock_wait",
    b"SELECT CASE WHEN current_setting('pglock.session', true) = $1"
    b" AND coalesce(current_setting('pglock.held', true), '') = ''"
    b" THEN pg_advisory_lock($2::int8)::text END",
)
_SET_TIMEOUT = (
    b"pglock_set_timeout",
    b"SELECT current_setting('lock_timeout'), set_config('lock_timeout', $1, false)",
)
# NULL leaves lock_timeout as it is; else the value it had before the wait.
_AFTER_WAIT = (
    b"pglock_after_wait",
    b"SELECT pg_backend_pid(), set_config('application_name', $1, false),"
    b" set_config('pglock.held', $2, false), pg_try_advisory_lock($4::int8),"
    b" set_config('lock_timeout', coalesce($3::text, current_setting('lock_timeout')), false)",
)
# Free at once (the session closes right after, but its end is not waited for).
_UNLOCK = (b"pglock_unlock", b"SELECT pg_advisory_unlock($1::int8), pg_advisory_unlock_all()")
# Back to the cache: no advisory lock of the holder's may stay, nor its name.
_UNLOCK_FOR_REUSE = (
    b"pglock_unlock_reuse",
    b"SELECT pg_advisory_unlock($1::int8), pg_advisory_unlock_all(),"
    b" set_config('application_name', $2, false), set_config('pglock.held', '', false)",
)
MAX_TIMEOUT = (2**31 - 1) / 1000

_current: ContextVar[AdvisoryLock | None] = ContextVar("pglock_current_lock", default=None)


def current_lock() -> AdvisoryLock | None:
    """Return the lock held by the task body running here, else None.

    Kept in a context variable: each thread, greenlet and process sees its own
    (a forked child does not inherit its parent's lock).
    """
    lock = _current.get()
    if lock is None or not lock.acquired:
        return None
    return lock


def _int(value: bytes | None) -> int | None:
    return int(value) if value is not None else None


def check_lock_name(name: str) -> str:
    """Return ``name`` if it can name a lock, else raise LockNameError saying why."""
    if not isinstance(name, str):
        raise LockNameError(f"a lock name must be a str, not {type(name).__name__}")
    if not name:
        raise LockNameError("a lock name may not be empty")
    if "\x00" in name:
        raise LockNameError(f"lock name {name!r} holds a NUL character, which Postgres refuses")
    return name


def check_timeout(timeout: float | None) -> float | None:
    """Return a wait timeout in seconds if Postgres can apply it, else raise ValueError."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise ValueError(f"lock timeout must be a number of seconds, not {timeout!r}")
    if math.isnan(timeout) or timeout < 0:
        raise ValueError(f"lock timeout must be 0 or more seconds, got {timeout!r}")
    if timeout > MAX_TIMEOUT:
        raise ValueError(
            f"lock timeout must be at most {MAX_TIMEOUT:.0f} s (Postgres' lock_timeout), "
            f"got {timeout!r}; use None to wait without a bound"
        )
    return float(timeout)


def _abandon(session: LockSession, hold: Hold | None, label: str) -> None:
    """A lock object dropped without release: have its session and lock freed."""
    abandoned.append(functools.partial(_free, session, hold, label))
    scheduler.wake()


def _free(session: LockSession, hold: Hold | None, label: str) -> None:
    if session.pid != os.getpid():
        return
    if hold is not None:
        hold.end()
        scheduler.unwatch(hold)
    if session.shared:
        if hold is not None:
            with contextlib.suppress(LockLost):
                shared.release(session, hold, label)
        return
    session.revoke("the lock was dropped without release")
    sessions.discard(session)


class AdvisoryLock:
    """A session-level Postgres advisory lock on a dedicated connection.

    Use it through :func:`try_lock` or :func:`wait_lock`. One object belongs to
    one caller; it may be acquired again after a failed try or a release.
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
            self.name: str | None = check_lock_name(name_or_key)
            self.key: int = lock_key(name_or_key)
        else:
            self.name = None
            self.key = check_key(name_or_key)
        self.config = config
        self.task_id = task_id
        self.application_name = application_name(config.application_name, self.label, task_id)
        self._wait = wait
        self._timeout = check_timeout(timeout)
        self._on_lost = on_lost
        self._reuse = config.strategy == sessions.REUSE
        self._shared = config.strategy == sessions.SHARED
        self._session: LockSession | None = None
        self._hold: Hold | None = None
        self._finalizer: weakref.finalize[Any, Any] | None = None

    @property
    def label(self) -> str:
        """The lock's name, or its key when it has none (for messages)."""
        return self.name if self.name is not None else f"#{self.key}"

    @property
    def acquired(self) -> bool:
        """Whether this process holds the lock through this object now."""
        hold = self._hold
        return hold is not None and hold.session.pid == os.getpid()

    @property
    def connection(self) -> psycopg.Connection[Any]:
        """The lock's own autocommit connection, while the lock is held.

        A handle of this holder's only: it starts with every client-side
        attribute at its default, and every statement through it (or a cursor
        made from it) fails once the lock is released.
        """
        hold = self._hold
        if hold is None:
            raise LockLost(f"lock {self.label} is not held: it has no connection")
        if hold.session.pid != os.getpid():
            raise LockLost(
                f"lock {self.label} is held by process {hold.session.pid}, not by this "
                "forked child: its connection is not this process's to use"
            )
        if hold.session.shared:
            raise PglockError(
                f"lock {self.label} is on a shared session, which has no connection of "
                "its own: write through `with lock.transaction() as conn:`"
            )
        with hold.session.guard:
            if hold.ended:
                raise LockLost(f"lock {self.label} was released: it has no connection")
            if hold.handle is None or hold.handle.closed:
                hold.handle = hold.session.handle()
            return hold.handle

    @property
    def lost_reason(self) -> str | None:
        """Why the lock was found lost while held, or None."""
        return self._hold.lost if self._hold is not None else None

    def __repr__(self) -> str:
        state = "held" if self.acquired else "not held"
        return f"<AdvisoryLock {self.label!r} key={self.key} {state}>"

    def acquire(self) -> bool:
        """Take the lock on a session of its own; return whether it is held.

        Raises LockUnavailable when no session can be opened or used, and
        LockTimeout when a waiting lock is not granted within its timeout.
        """
        if self._hold is not None:
            raise RuntimeError(f"lock {self.label} is already held by this object")
        free_abandoned()
        if self._shared:
            return self._acquire_shared()
        session = self._session  # kept from a failed try, for polling
        self._session = None
        if session is None and self._reuse:
            session = sessions.take(self.config)
        got = False
        if session is not None:
            try:
                got = self._lock_on(session)
            except psycopg.Error:
                # An idle session that died or went wrong meanwhile: it held
                # nothing, so a fresh one may take its place.
                sessions.discard(session)
                session = None
            except BaseException:
                sessions.discard(session)
                raise
        if session is None:
            startup = idle_name(self.config.application_name) if self._reuse else None
            session = open_session(self.config, startup or self.application_name)
            try:
                got = self._lock_on(session)
            except psycopg.Error as exc:
                sessions.discard(session)
                raise LockUnavailable(
                    f"lock {self.label}: the lock session failed while locking: {one_line(exc)}"
                ) from exc
            except BaseException:
                sessions.discard(session)
                raise
        self._settle(session, self._make_hold(session) if got else None)
        return got

    def _make_hold(self, session: LockSession) -> Hold:
        return Hold(
            session,
            key=self.key,
            label=self.label,
            application_name=self.application_name,
            task_id=self.task_id,
            config=self.config,
            on_lost=self._on_lost,
        )

    def _settle(self, session: LockSession | None, hold: Hold | None) -> None:
        """Keep what acquire got, watched, and freed if this object is dropped."""
        self._session, self._hold = session, hold
        if hold is not None:
            scheduler.watch(hold)
        if self._finalizer is not None:
            self._finalizer.detach()  # an earlier failed try's
            self._finalizer = None
        if session is not None and (hold is not None or not session.shared):
            self._finalizer = weakref.finalize(self, _abandon, session, hold, self.label)

    def _acquire_shared(self) -> bool:
        session, hold = shared.acquire(
            self.config,
            self.key,
            self.label,
            wait=self._wait,
            timeout=self._timeout,
            open_one=self._open_shared,
            make_hold=self._make_hold,
        )
        self._settle(session, hold)
        return hold is not None

    def _open_shared(self) -> LockSession:
        session = open_session(self.config, shared.shared_name(self.config.application_name))
        session.on_failure = functools.partial(shared.fail, session)
        return session

    def _lock_on(self, session: LockSession) -> bool:
        """Take the lock on ``session`` (a fresh or a cached one); return whether granted."""
        key = str(self.key).encode()
        name = self.application_name.encode()
        held = b"," + key + b","
        if not self._wait:
            result = session.query(*_TRY, (name, held, session.token.encode(), key))
            got = result.get_value(0, 0)
            if got is None:
                raise self._moved(session, _int(result.get_value(0, 1)))
            self._check_backend(session, _int(result.get_value(0, 1)))
            return got == b"t"
        with session.guard:
            restore = None
            if self._timeout is not None:
                # lock_timeout = 0 means "forever" to Postgres: wait at least 1 ms.
                millis = max(1, round(self._timeout * 1000))
                restore = session.query(*_SET_TIMEOUT, (b"%dms" % millis,)).get_value(0, 0)
            try:
                waited = session.query(*_WAIT, (session.token.encode(), key))
            except pg_errors.LockNotAvailable:
                raise LockTimeout(
                    f"lock {self.label} not obtained within {self._timeout:g} s"
                ) from None
            if waited.get_value(0, 0) is None:
                raise self._moved(session, None)
            result = session.query(*_AFTER_WAIT, (name, held, restore, key))
        self._check_backend(session, _int(result.get_value(0, 0)))
        return True

    def _check_backend(self, session: LockSession, backend_pid: int | None) -> None:
        if backend_pid != session.backend_pid:
            raise self._moved(session, backend_pid)

    def _moved(self, session: LockSession, backend_pid: int | None) -> LockUnavailable:
        """The error for a lock statement that did not run on the session's own backend."""
        return LockUnavailable(
            f"lock {self.label}: the lock statement did not run on the session's own "
            f"backend {session.backend_pid} (it ran on {backend_pid or 'another'}, without "
            "this session's token, or with an earlier holder's lock): a pooler moved the "
            "session, so it fails closed"
        )

    def holder(self) -> Holder | None:
        """Return who holds the lock now, asked on this lock's session.

        Found by the name in the holders' application_name (pg_stat_activity,
        never pg_locks: a skip costs the same with 10,000 locks on the server);
        None for a holder that does not name its session.
        """
        session = self._session
        if session is None or session.pid != os.getpid():
            return None
        try:
            result = session.query(*NAMED_HOLDER, named_holder_params(self.label))
        except psycopg.Error as exc:
            logger.warning(
                "lock %s: could not look up its holder: %s",
                self.label,
                one_line(exc),
                extra={"lock": self.label, "key": self.key},
            )
            return None
        if not result.ntuples:
            return None
        row = [result.get_value(0, column) for column in range(result.nfields)]
        return named_holder(self.key, self.label, row)

    def held(self) -> bool:
        """Ask Postgres whether this session still holds the lock.

        A session that cannot be asked (closed, broken) holds nothing. Inside
        the body's transaction only the session's life can be checked without
        disturbing the transaction; the lock lives as long as the session.
        """
        hold = self._hold
        if hold is None or hold.lost is not None or hold.session.pid != os.getpid():
            return False
        reason = hold.check(wait=True)
        if reason is not None:
            hold.mark_lost(reason)
            return False
        return not hold.session.closed

    def ensure_held(self) -> None:
        """Raise LockLost unless Postgres confirms the lock is still held."""
        hold = self._hold
        if hold is not None and hold.lost is not None:
            raise LockLost(f"lock {self.label} was lost: {hold.lost}")
        if not self.held():
            hold = self._hold
            if hold is not None and hold.lost is not None:
                raise LockLost(f"lock {self.label} was lost: {hold.lost}")
            raise LockLost(f"lock {self.label} (key {self.key}) is no longer held")

    def sleep(self, seconds: float) -> None:
        """Sleep, but raise LockLost as soon as the lock is found lost."""
        hold = self._hold
        if hold is None:
            raise LockLost(f"lock {self.label} is not held")
        if hold.changed.wait(seconds) and hold.lost is not None:
            raise LockLost(f"lock {self.label} was lost: {hold.lost}")

    def release(self, reusable: bool = True) -> None:
        """Unlock and let the session go; idempotent.

        Every handle given to the holder is revoked first. An open transaction
        is rolled back: it was made under the lock and must not outlive it.
        Raises LockLost when the unlock shows the lock was already gone (false,
        or a failed session). A session goes back to this process's cache
        (strategy ``reuse``) only when ``reusable``, the unlock returned true
        and nothing else is in doubt; otherwise it is closed, which would free
        the lock anyway. In a forked child nothing is sent: the session is the
        parent's.
        """
        session, hold = self._session, self._hold
        self._session = self._hold = None
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None
        if session is None:
            return
        if session.pid != os.getpid():
            if hold is not None:  # a forked child: the parent's session, its guard too
                hold.end()
            return
        if hold is not None:
            with session.guard:  # no handle is given out after this
                hold.end()
            scheduler.unwatch(hold)
        if session.shared:
            if hold is not None:
                shared.release(session, hold, self.label)
            return  # the session stays, for the process's other locks
        keep = False
        try:
            if hold is None:
                keep = self._reuse and reusable  # nothing was taken on this session
                return
            keep = self._unlock(session, hold) and self._reuse and reusable
            if keep and session.handed_out:
                try:
                    session.conn.execute("DISCARD ALL")  # the holder's server state goes
                    session.forget_prepared()
                except psycopg.Error:
                    keep = False
        finally:
            if not (keep and sessions.give_back(self.config, session)):
                sessions.discard(session)

    def _unlock(self, session: LockSession, hold: Hold) -> bool:
        """Unlock; return whether the session may be used again, or raise LockLost."""
        session.revoke(f"lock {self.label} was released: this connection is closed")
        clean = True
        try:
            with session.guard:
                status = session.pgconn.transaction_status
                if status not in (TransactionStatus.IDLE, TransactionStatus.UNKNOWN):
                    if status == TransactionStatus.ACTIVE:
                        # A statement still runs (another thread of the holder):
                        # closing the session is the only clean way out.
                        return False
                    session.conn.rollback()
                    clean = False
                key = str(self.key).encode()
                if self._reuse:
                    idle = idle_name(self.config.application_name).encode()
                    unlocked = session.query(*_UNLOCK_FOR_REUSE, (key, idle)).get_value(0, 0)
                else:
                    unlocked = session.query(*_UNLOCK, (key,)).get_value(0, 0)
        except psycopg.Error as exc:
            raise LockLost(
                f"lock {self.label}: the session failed at release, so the lock "
                f"was lost before it: {one_line(exc)}"
            ) from exc
        if unlocked != b"t":
            raise LockLost(f"lock {self.label} was no longer held at release")
        if hold.lost is not None:
            raise LockLost(f"lock {self.label} was lost while held: {hold.lost}")
        return clean and not session.pgconn.pipeline_status

    @contextlib.contextmanager
    def transaction(self) -> Iterator[psycopg.Connection[Any]]:
        """Yield the lock's connection inside a transaction that commits only while held.

        The lock can only go with its session, and then the commit fails too.
        Under strategy ``shared`` the transaction has the session to itself
        (other holders on it wait), and what it left on the session is reset.
        """
        hold = self._hold
        if hold is None or hold.session.pid != os.getpid():
            raise LockLost(f"lock {self.label} is not held: no transaction without it")
        if hold.session.shared:
            with shared.transaction(hold, self.label) as conn:
                yield conn
            return
        conn = self.connection
        with conn.transaction():
            yield conn

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
