"""The advisory lock a caller holds: acquire, held, release.

Each granted acquire is a *hold* (monitor.py), watched for loss from grant to
release. Where its session comes from is the business of its source
(sources/): the lock asks it for a session and the lock, and gives both back at
release, whatever the strategy. A release returns only once the server freed
the lock, so any other session can take it at once.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
import weakref
from contextvars import ContextVar
from types import TracebackType
from typing import Any

import psycopg
from celery import current_app
from celery._state import get_current_task

from .config import PglockConfig, get_config
from .dsn import database_address
from .exceptions import LockLost, PglockError
from .inspect import Holder
from .keys import cached_lock_key, check_key, check_lock_name, check_timeout, lock_key
from .loss import Loss
from .monitor import Hold, LossHandler
from .rollout import known_database
from .session import compose_holder_name, holder_name, idle_name, open_session
from .shield import library_code
from .sources import registry
from .sources.base import Source

logger = logging.getLogger("pglock_celery.lock")

#: Names longer than this many characters are not cached (their keys, their session names).
MAX_CACHED_NAME = 256

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


def _one_database(before: PglockConfig, now: PglockConfig) -> bool:
    """Whether a moving name's previous shard and its new one are one database under
    two DSNs: written alike once libpq's defaults are in (dsn.database_address), or
    found so by the transition's lock sessions (a session opened, never locking, on a
    DSN not met yet). Taken on both, the second lock would wait on the first."""
    address = database_address(before.dsn)
    if address is not None and address == database_address(now.dsn):
        return True  # one database however the two DSNs are written (task.py does alike)
    found = []
    for config in (before, now):
        dsn = config.require_dsn()
        where = known_database(dsn)
        if where is None:
            with registry.opening(config):
                open_session(config, idle_name(config.application_name), takes_locks=False).close()
            where = known_database(dsn)
        found.append(where)
    return found[0] is not None and found[0] == found[1]


class AdvisoryLock:
    """A session-level Postgres advisory lock on a lock session of its own.

    Use it through ``try_lock()`` or ``wait_lock()``. One object belongs to
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
            """The lock's name; None when it was given a bare int key."""
            # What a process keeps after release is bounded in bytes: long names
            # are not cached.
            cached = len(name_or_key) <= MAX_CACHED_NAME
            self.key: int = (cached_lock_key if cached else lock_key)(name_or_key)
            """The advisory lock key, signed 64-bit (``lock_key(name)`` for a name)."""
        else:
            self.name = None
            self.key = check_key(name_or_key)
            cached = True
        previous = config.previous_for_key(self.key, self.name)
        config = config.for_key(self.key, self.name)
        self.config = config
        """The pglock settings the lock was made with (its DSN among them), its
        shard's under ``pglock_shards``."""
        self.task_id = task_id
        """The task id the lock's session is named after, if any."""
        self.label = self.name if self.name is not None else f"#{self.key}"
        """The lock's name, or ``#<key>`` when it has none (for messages)."""
        self.application_name = (holder_name if cached else compose_holder_name)(
            config.application_name, self.label, task_id, os.getpid()
        )
        """The application_name its session shows in ``pg_stat_activity`` while held."""
        self._wait = wait
        self._timeout = check_timeout(timeout)
        self._on_lost = on_lost
        self._hold: Hold | None = None
        # The loss of the hold last released, if it was lost.
        self._released_loss: Loss | None = None
        #: Where the session of the last acquire came from.
        self._source: Source = registry.source(config)
        #: While the shards change (pglock_shards_previous), a moving name's lock on its
        #: previous shard: taken first and let go last, so that workers on either map
        #: exclude this one (shards.py). Its loss is this lock's.
        self._previous: AdvisoryLock | None = None
        if previous is not None:
            self._previous = AdvisoryLock(
                name_or_key, config=previous, wait=wait, timeout=timeout, task_id=task_id,
                on_lost=self._previous_lost,
            )  # fmt: skip
        #: Whether the last acquire of a moving name was refused on its previous shard
        #: (holder() then asks there).
        self._refused_before = False
        self._finalizer: weakref.finalize[Any, Any] | None = None
        # The thread (and greenlet) that acquired it: the only one that runs its body.
        self._owner: tuple[int, int] | None = None

    def owned_here(self) -> bool:
        """Whether the caller runs in the thread (and greenlet) that took the lock.

        A context copied into another thread (``asyncio.to_thread``, an executor
        given ``copy_context().run``) sees the same current_lock(), but is not the
        body that holds it.
        """
        return self._owner is not None and self._owner == _caller()

    @property
    def acquired(self) -> bool:
        """Whether this process holds the lock through this object now."""
        hold = self._hold
        return (
            hold is not None
            and hold.granted
            and hold.session is not None
            and hold.session.pid == os.getpid()
            and (self._previous is None or self._previous.acquired)
        )

    @property
    def backend_pid(self) -> int | None:
        """The server's pid of the lock session's backend while held, else None."""
        return self._hold.session.backend_pid if self.acquired else None  # type: ignore[union-attr]

    @property
    def connection(self) -> psycopg.Connection[Any]:
        """The lock's own autocommit connection, while the lock is held.

        A handle of this holder's only: it starts with every client-side
        attribute at its default, and every statement through it (or a cursor
        made from it) fails once the lock is released.
        """
        with library_code():
            hold = self._held_here("it has no connection")
            return self._source.connection(hold)

    @property
    def lost_reason(self) -> str | None:
        """Why the lock was found lost while held (for people), or None."""
        loss = self.loss
        return loss.detail if loss is not None else None

    @property
    def loss(self) -> Loss | None:
        """How the lock was found lost while held (its kind and detail), or None.

        Kept after release, until the next acquire.
        """
        return self._hold.lost if self._hold is not None else self._released_loss

    def __repr__(self) -> str:
        state = "held" if self.acquired else "not held"
        return f"<AdvisoryLock {self.label!r} key={self.key} {state}>"

    def _held_here(self, what: str) -> Hold:
        hold = self._hold
        if hold is None or not hold.granted or hold.session is None:
            raise LockLost(f"lock {self.label} is not held: {what}")
        if hold.session.pid != os.getpid():
            raise LockLost(
                f"lock {self.label} is held by process {hold.session.pid}, not by this "
                f"forked child: {what}"
            )
        if hold.ended:
            raise LockLost(f"lock {self.label} was released: {what}")
        if hold.lost is not None:
            raise LockLost(f"lock {self.label} was lost: {hold.lost}")
        return hold

    def acquire(self) -> bool:
        """Take the lock on a session of its own; return whether it is held.

        Raises LockUnavailable when no session can be opened or used, and
        LockTimeout when a waiting lock is not granted within its timeout. Inside
        a body whose own lock is lost meanwhile, the body's LockLost comes once
        this acquire is over, and a lock it took is let go first (nothing of it
        stays held).
        """
        self._refused_before = False
        previous = self._previous
        if previous is not None and _one_database(previous.config, self.config):
            # Two DSNs of one database: its one lock there excludes either map.
            self._previous = previous = None
        if previous is None:
            return self._acquire_here(self._timeout)
        # A moving name: its previous shard first, always (one order for every worker).
        started = time.monotonic()
        if not previous.acquire():
            self._refused_before = True
            return False

        def left() -> float | None:
            spent = time.monotonic() - started
            return None if self._timeout is None else max(0.0, self._timeout - spent)

        granted = alone = False
        try:
            # Tried before any wait: the lock in the way may be this one's own on its
            # previous shard, both DSNs found (as their sessions opened just now, after
            # a failover say) to reach one database. Then it is taken there alone.
            granted = self._acquire_here(left(), wait=False)
            if not granted:
                alone = _one_database(previous.config, self.config)
                if not alone and self._wait:
                    granted = self._acquire_here(left())
        finally:
            if not granted:
                with contextlib.suppress(PglockError):
                    previous.release()
        if alone:
            self._previous = None
            return self._acquire_here(left())
        if granted and previous.loss is not None:  # lost while this one was taken: no lock
            with contextlib.suppress(PglockError):
                self.release(reusable=False)
            raise LockLost(f"lock {self.label} was granted but not valid: {previous.loss}")
        return granted

    def _previous_lost(self, hold: Hold, loss: Loss) -> None:
        """The lock on the previous shard was lost: so is this one (reported once)."""
        own = self._hold
        if own is not None and own.granted and not own.ended and own.lost is None:
            own.mark_lost(Loss(loss.kind, f"on its previous shard: {loss.detail}"))
            return
        if own is None and self._released_loss is None:
            # Found as the lock was let go (its own shard's half first): still its loss.
            self._released_loss = Loss(loss.kind, f"on its previous shard: {loss.detail}")
        if self._on_lost is not None:
            self._on_lost(hold, loss)

    def _acquire_here(self, timeout: float | None, wait: bool | None = None) -> bool:
        try:
            with library_code():
                return self._acquire(timeout, self._wait if wait is None else wait)
        except LockLost:
            if self._hold is not None and self._hold.granted:
                with contextlib.suppress(PglockError):
                    self.release(reusable=False)
            raise

    def _acquire(self, timeout: float | None, wait: bool) -> bool:
        if self._hold is not None:
            if self._hold.granted:
                raise RuntimeError(f"lock {self.label} is already held by this object")
            self._release(True)  # a refused try's session goes back first (this shard's alone)
        monitor = registry.monitor
        if monitor.abandoned:
            monitor.free_abandoned()
        source = self._source
        hold = Hold(
            source,
            key=self.key,
            label=self.label,
            application_name=self.application_name,
            task_id=self.task_id,
            config=self.config,
            on_lost=self._on_lost,
        )
        granted = source.acquire(hold, wait=wait, timeout=timeout)
        if granted and source.fence is not None:
            loss = source.leader_problem(hold.session)
            if loss is not None:  # a lock on a server that may not lead is no lock
                with contextlib.suppress(PglockError):
                    source.release(hold, clean=False)
                raise LockLost(f"lock {self.label} was granted but not valid: {loss}")
        self._hold = hold
        self._owner = _caller()
        if granted:
            monitor.watch(hold)
        # Dropped without release, the lock and its session are still freed.
        self._finalizer = weakref.finalize(self, _abandon, source, hold)
        return granted

    def holder(self) -> Holder | None:
        """Return who holds the lock now, asked on this lock's session.

        Read from the lock (its key in pg_locks, granted), never from a session's
        name: a session named for it that only waits is no holder. None when nobody
        holds it.
        """
        if self._refused_before and self._previous is not None:
            return self._previous.holder()  # a moving name refused on its previous shard
        hold = self._hold
        return self._source.holder(hold) if hold is not None else None

    def held(self) -> bool:
        """Ask Postgres whether this session still holds the lock; always a bool.

        A session that cannot be asked (closed, broken) holds nothing. A session
        busy in the holder's pipeline, COPY or transaction, or in another thread's
        statement, is judged from outside (its socket, the server's view), never
        waited for. A loss found here is handled whole (the
        session cut off, the holder's loss handler told) before False returns; no
        LockLost is raised from it.
        """
        with library_code():
            if not self.acquired:
                return False
            hold = self._hold
            assert hold is not None and hold.session is not None
            if hold.lost is not None:
                return False
            loss = self._source.check(hold)
            if loss is not None:
                hold.mark_lost(loss)
                return False
            if self._previous is not None and not self._previous.held():
                return False  # its loss is this lock's now (_previous_lost)
            return not hold.session.closed

    def ensure_held(self) -> None:
        """Raise LockLost unless Postgres confirms the lock is still held."""
        with library_code():
            if not self.held():
                hold = self._hold
                if hold is not None and hold.lost is not None:
                    raise LockLost(f"lock {self.label} was lost: {hold.lost}")
                raise LockLost(f"lock {self.label} (key {self.key}) is no longer held")

    def sleep(self, seconds: float) -> None:
        """Sleep, but raise LockLost as soon as the lock is found lost."""
        with library_code():
            hold = self._held_here("nothing to sleep under")
            if hold.wait(seconds) and hold.lost is not None:
                raise LockLost(f"lock {self.label} was lost: {hold.lost}")

    def release(self, reusable: bool = True, *, confirm: bool = False) -> None:
        """Unlock, wait until the server freed the lock, and let the session go; idempotent.

        When it returns, any other session can take the lock at once. Every
        handle given to the holder is revoked first. An open transaction is
        rolled back: it was made under the lock and must not outlive it. Raises
        LockLost when the unlock shows the lock was already gone (false, or a
        failed session). A session goes back to its source for reuse only when
        ``reusable`` and nothing is in doubt. ``confirm`` is accepted for
        compatibility: every release waits. In a forked child nothing is sent:
        the session is the parent's.
        """
        with library_code():
            try:
                self._release(reusable)
            finally:
                if self._previous is not None:
                    self._previous.release(reusable)

    def _release(self, reusable: bool) -> None:
        hold, self._hold = self._hold, None
        self._released_loss = hold.lost if hold is not None else None
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None
        if hold is None or hold.session is None:
            return
        session = hold.session
        if session.pid != os.getpid():
            hold.end()  # a forked child: the parent's session, its guard too
            return
        # No handle is given out after this. A statement of another thread's that
        # keeps the guard is not waited for past the deadline: the source ends it.
        taken = session.guard.acquire(timeout=session.statement_deadline)
        try:
            hold.end()
        finally:
            if taken:
                session.guard.release()
        self._source.monitor.unwatch(hold)
        try:
            self._source.release(hold, clean=reusable)
        except LockLost:
            if hold.lost is None and hold.found_at_release is not None:
                # Found by the release itself: reported like any other loss (once).
                hold.lost_at_release(hold.found_at_release)
                self._released_loss = hold.lost
            raise

    def transaction(self) -> contextlib.AbstractContextManager[psycopg.Connection[Any]]:
        """Yield the lock's connection inside a transaction that commits only while held.

        It first proves, without waiting, that the session still holds the lock
        (LockLost at once when not: it never takes the lock back), keeps it pinned
        for the transaction, and asks the leader fence again before the commit. A
        moving name's lock on its previous shard (a change of the shards) is proven
        at the start and before the commit too. Under strategy ``shared`` it refuses
        (PglockError): a shared session never runs a holder's SQL.
        """
        with library_code():
            hold = self._held_here("no transaction without it")
            if self._previous is None:
                return self._source.transaction(hold)
            # A moving name: its previous shard's lock too, proven at the start and
            # again just before the commit (its own server cannot pin it).
            self._ensure_previous_held()
            return self._source.transaction(hold, self._ensure_previous_held)

    def _ensure_previous_held(self) -> None:
        """LockLost unless a moving name's lock on its previous shard is still held (a
        loss found there is this lock's, handled whole first)."""
        previous = self._previous
        if previous is not None and not previous.held():
            loss = self.loss or previous.loss
            detail = loss.detail if loss is not None else "no longer held"
            raise LockLost(f"lock {self.label} was lost on its previous shard: {detail}")

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

        A lost lock raises LockLost, unless ``error`` is already on its way: then
        the caller sees its own exception (the loss was logged, once, by whoever
        found it).
        """
        try:
            # A session whose holder failed is not trusted again.
            self.release(reusable=error is None)
        except LockLost as lost:
            if error is None:
                raise
            logger.debug(
                "%s (while the body raised %s)",
                lost,
                type(error).__name__,
                extra={"lock": self.label, "key": self.key},
            )


def _caller() -> tuple[int, int]:
    """The calling thread and greenlet (0 without greenlet)."""
    greenlet = sys.modules.get("greenlet")
    return threading.get_ident(), id(greenlet.getcurrent()) if greenlet is not None else 0


def _abandon(source: Source, hold: Hold) -> None:
    """A lock object dropped without release: have the monitor thread free its session."""
    source.monitor.abandon(lambda: _free(source, hold))


def _free(source: Source, hold: Hold) -> None:
    session = hold.session
    if session is None or session.pid != os.getpid():
        return
    hold.end()
    source.monitor.unwatch(hold)
    with contextlib.suppress(PglockError):
        source.release(hold, clean=False)


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


def shard_of(name_or_key: str | int) -> str:
    """The name of the shard (of ``pglock_shards``) that the lock lives on.

    ``"default"`` without shards. For the current Celery app's settings, else the
    ``PGLOCK_*`` environment, as for try_lock.
    """
    config = _config_for(None)
    if isinstance(name_or_key, str):
        name: str | None = check_lock_name(name_or_key)
        key = lock_key(name_or_key)
    else:
        name, key = None, check_key(name_or_key)
    return config.shard_of(key, name)


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
