"""The advisory lock: try or wait, held(), ensure_held(), release.

Each granted acquire is a *hold* (monitor.py), the lock's session from grant
to release, watched for loss. A hold has its session to itself (strategy
``connect`` opens one, ``reuse`` checks one out of this process's idle
sessions, see sessions.py; ``shared`` shares a few, see shared.py):
session-level advisory locks are re-entrant within a session, so two holders on
one session would both get in. Every lock statement proves that it ran on the
session's own backend, so a session moved by a pooler fails closed instead of
locking elsewhere (protocol.py).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import weakref
from collections.abc import Iterator
from contextvars import ContextVar
from types import TracebackType
from typing import Any

import psycopg
from celery import current_app
from celery._state import get_current_task

from . import protocol, sessions, shared
from .config import PglockConfig, get_config
from .connection import application_name, open_session
from .exceptions import LockLost, PglockError
from .inspect import Holder, holder_on
from .keys import cached_lock_key, check_key, check_lock_name, check_timeout
from .lock_session import LockSession
from .monitor import Hold, LossHandler
from .scheduler import abandon, free_abandoned, scheduler

logger = logging.getLogger("pglock_celery.lock")

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
            self.key: int = cached_lock_key(name_or_key)
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
        kept, self._session = self._session, None  # kept from a failed try, for polling
        session, got = protocol.acquire(
            self.config, kept, self._lock_on, self.label, self.application_name, wait=self._wait
        )
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
            self._finalizer = weakref.finalize(self, abandon, session, hold, self.label)

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
        return protocol.lock_on(
            session,
            self.key,
            self.application_name,
            self.label,
            wait=self._wait,
            timeout=self._timeout,
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
        return holder_on(session, self.key, self.label)

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
        if hold.wait(seconds) and hold.lost is not None:
            raise LockLost(f"lock {self.label} was lost: {hold.lost}")

    def release(self, reusable: bool = True, *, confirm: bool = False) -> None:
        """Unlock and let the session go; idempotent.

        Every handle given to the holder is revoked first. An open transaction
        is rolled back: it was made under the lock and must not outlive it.
        Raises LockLost when the unlock shows the lock was already gone (false,
        or a failed session). A session goes back to this process's cache
        (strategy ``reuse``) only when ``reusable``, the unlock returned true
        and nothing else is in doubt; otherwise it is closed, which would free
        the lock anyway. Going back, its unlock is sent without waiting, and a
        loss it shows is reported later (see protocol.py); the server frees the
        lock as it reads it. With ``confirm`` the release returns only once the
        lock is free: for work handed on that must be able to take it at once.
        In a forked child nothing is sent: the session is the parent's.
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
        protocol.release(
            session, hold, self.config, reusable=self._reuse and reusable, confirm=confirm
        )

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

    def finish(self, error: BaseException | None, *, confirm: bool = False) -> None:
        """Release after the guarded code ended, with ``error`` if it raised.

        A lost lock raises LockLost, unless ``error`` is already on its way:
        then the loss is logged and the caller sees its own exception.
        """
        try:
            # A session whose holder failed is not trusted again.
            self.release(reusable=error is None, confirm=confirm)
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
