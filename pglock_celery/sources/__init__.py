"""Where lock sessions come from: one interface, two implementations, one registry.

A :class:`Source` gives a lock a session and takes it back: ``acquire`` (find a
session and try the lock on it), ``release`` (unlock, wait for the server to
free it, let the session go), ``check`` (is the lock still held?), ``close``.
The lock (lock.py) only ever talks to this interface:

- :class:`~.dedicated.DedicatedSource`: a session to itself for each holder,
  opened per lock (strategy ``connect``) or taken from this process's idle ones
  (``reuse``);
- :class:`~.shared.SharedSource`: every lock of the process on at most
  ``pglock_shared_sessions`` sessions (strategy ``shared``).

The :data:`registry` is the one piece of per-process state: the sources of this
process, one per configuration, and the loss monitor. One fork hook keeps a
forked child off its parent's sessions.
"""

from __future__ import annotations

import abc
import contextlib
import os
import threading
from collections.abc import Iterator
from typing import Any

import psycopg

from .. import sql
from ..config import PglockConfig
from ..inspect import Holder, holder_on
from ..monitor import Hold, Monitor, one_line
from ..session import LockSession

#: The strategies, as pglock_strategy names them.
CONNECT, REUSE, SHARED = "connect", "reuse", "shared"


class Source(abc.ABC):
    """Where the sessions of one configuration come from, and how a lock is taken on one."""

    def __init__(self, config: PglockConfig, registry: Registry) -> None:
        self.config = config
        self.registry = registry
        self.monitor = registry.monitor
        # Serialises this source's own bookkeeping (never held across a statement).
        self._mutex = threading.Lock()
        #: Every session this source opened and has not closed (a fork closes them).
        self._sessions: set[LockSession] = set()

    @abc.abstractmethod
    def acquire(self, hold: Hold, *, wait: bool, timeout: float | None) -> bool:
        """Find a session for ``hold`` and take its lock there; whether it was granted.

        Sets ``hold.session``, also when the lock was not granted (the holder
        lookup asks on it). Raises LockUnavailable when no session can be used
        and LockTimeout when a wait ran out.
        """

    @abc.abstractmethod
    def release(self, hold: Hold, *, clean: bool) -> None:
        """Unlock ``hold`` and return once the server freed the lock.

        Raises LockLost when the lock turns out to have been lost before. A
        session whose holder failed (``clean`` False) is not trusted again.
        """

    @abc.abstractmethod
    def connection(self, hold: Hold) -> psycopg.Connection[Any]:
        """The holder's own connection on its session (a new handle when needed)."""

    @abc.abstractmethod
    def transaction(self, hold: Hold) -> contextlib.AbstractContextManager[psycopg.Connection[Any]]:
        """A connection inside a transaction that can commit only while the lock is held."""

    @abc.abstractmethod
    def lost(self, hold: Hold, reason: str) -> None:
        """Deal with ``hold``'s session after its lock was found lost for ``reason``."""

    @abc.abstractmethod
    def close(self) -> None:
        """Close every session that holds nothing (idle sessions, quiet shared ones)."""

    def check(self, hold: Hold, *, wait: bool) -> str | None:
        """Return why ``hold``'s lock is lost, or None while held (or when it cannot ask).

        Runs under the session's guard, so no statement of the holder can start
        in between; with ``wait`` False it gives up at once when one is running.
        """
        session = hold.session
        if session is None or not session.guard.acquire(blocking=wait):
            return None
        try:
            if hold.ended or hold.lost is not None:
                return hold.lost
            if session.pgconn.pipeline_status:
                return None  # results of the holder's pipeline are on their way
            status = session.pgconn.transaction_status
            if status == psycopg.pq.TransactionStatus.IDLE:
                try:
                    result = session.query(*sql.CHECK, (str(hold.key).encode(),))
                except psycopg.Error as exc:
                    return f"the lock session failed: {one_line(exc)}"
                if result.get_value(0, 0) == b"t":
                    return "the server is in recovery (a failover?)"
                if result.get_value(0, 1) != b"t":
                    return "the session no longer holds the lock"
                return None
            if status in (
                psycopg.pq.TransactionStatus.INTRANS,
                psycopg.pq.TransactionStatus.INERROR,
            ):
                if not session.alive():
                    return "the lock session failed: the server closed it"
                return None
            if session.closed:
                return "the lock session failed: it is closed"
            return None  # a statement of the holder's is under way
        finally:
            session.guard.release()

    def holder(self, hold: Hold) -> Holder | None:
        """Who holds ``hold``'s lock now, asked on its session; None when unknown."""
        session = hold.session
        if session is None or session.pid != os.getpid() or session.closed:
            return None
        return holder_on(session, hold.key, hold.label)

    def _register(self, session: LockSession) -> None:
        with self._mutex:
            self._sessions.add(session)

    def _discard(self, session: LockSession) -> None:
        """Close a session and forget it (closed first: a fork in between finds it gone)."""
        session.close()
        with self._mutex:
            self._sessions.discard(session)

    def after_fork_in_child(self) -> list[LockSession]:
        """Forget every session of the parent's; return them (kept, never finalized)."""
        self._mutex = threading.Lock()
        inherited = list(self._sessions)
        self._sessions.clear()
        for session in inherited:
            session.forget_after_fork()
        return inherited


class Registry:
    """This process's sources, one per configuration, and its loss monitor."""

    #: How long a fork waits for sessions being opened before it goes ahead anyway.
    FORK_WAIT = 30.0

    def __init__(self) -> None:
        self.monitor = Monitor()
        #: The sources made so far (read without a lock: a dict lookup is atomic).
        self.by_config: dict[PglockConfig, Source] = {}
        self._mutex = threading.Lock()
        # Sockets being opened, not registered yet: a fork waits for them.
        self._opening = 0
        self._fork_barrier = threading.Condition()
        # A child's copies of its parent's sessions: kept alive, never finalized.
        self._inherited: list[LockSession] = []

    def source(self, config: PglockConfig) -> Source:
        """The source of ``config``'s sessions in this process (made on first use)."""
        found = self.by_config.get(config)
        if found is not None:
            return found
        from .dedicated import DedicatedSource
        from .shared import SharedSource

        with self._mutex:
            found = self.by_config.get(config)
            if found is None:
                kind = SharedSource if config.strategy == SHARED else DedicatedSource
                found = self.by_config[config] = kind(config, self)
            return found

    def sources(self) -> list[Source]:
        with self._mutex:
            return list(self.by_config.values())

    @contextlib.contextmanager
    def opening(self) -> Iterator[None]:
        """Around opening a session until its source registered it: a fork meanwhile waits.

        A child forked while a socket exists that is not registered yet would keep
        a copy of it open, and with it the parent's locks after the parent died.
        """
        with self._fork_barrier:
            self._opening += 1
        try:
            yield
        finally:
            with self._fork_barrier:
                self._opening -= 1
                if not self._opening:
                    self._fork_barrier.notify_all()

    def close(self) -> None:
        """Close every session of this process that holds nothing."""
        for source in self.sources():
            source.close()

    def idle_count(self) -> int:
        """Idle sessions this process keeps (strategy ``reuse``; for tests and benchmarks)."""
        return sum(getattr(source, "idle_count", lambda: 0)() for source in self.sources())

    def shared_count(self) -> int:
        """Shared sessions this process has open (for tests and benchmarks)."""
        return sum(getattr(source, "session_count", lambda: 0)() for source in self.sources())

    def _before_fork(self) -> None:
        self._fork_barrier.acquire()
        self._fork_barrier.wait_for(lambda: self._opening == 0, timeout=self.FORK_WAIT)

    def _after_fork_in_parent(self) -> None:
        self._fork_barrier.release()

    def _after_fork_in_child(self) -> None:
        # The parent's threads are gone; a lock one of them held would never be released.
        self._mutex = threading.Lock()
        self._fork_barrier, self._opening = threading.Condition(), 0
        for source in self.by_config.values():
            self._inherited += source.after_fork_in_child()
        self.by_config = {}
        self.monitor.after_fork_in_child()


#: This process's sessions and monitor (the only module-level state of the library's core).
registry = Registry()
os.register_at_fork(
    before=registry._before_fork,
    after_in_parent=registry._after_fork_in_parent,
    after_in_child=registry._after_fork_in_child,
)
