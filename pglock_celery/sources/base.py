"""The interface between a lock and where its session comes from (see sources/__init__.py)."""

from __future__ import annotations

import abc
import contextlib
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import psycopg
from psycopg import pq

from .. import sql
from ..config import PglockConfig
from ..exceptions import LockLost
from ..inspect import Holder, holder_on
from ..monitor import Hold, Monitor, one_line
from ..patroni import LeaderFence
from ..session import LockSession


class Registry(Protocol):
    """What a source needs of its process's registry (sources/__init__.py)."""

    monitor: Monitor

    def opening(self) -> contextlib.AbstractContextManager[None]: ...


class LeaderProblem(str):
    """Why a session's server is not confirmed as the leader: every lock on it is lost."""


#: The strategies, as pglock_strategy names them.
CONNECT, REUSE, SHARED = "connect", "reuse", "shared"


@contextlib.contextmanager
def fenced_transaction(
    session: LockSession,
    handle: psycopg.Connection[Any],
    keys: list[int],
    own: int,
    before_commit: Callable[[], None],
) -> Iterator[psycopg.Connection[Any]]:
    """``handle`` inside a transaction that can commit only while the session holds ``keys``.

    Every key of the session is pinned for the transaction's length (sql.py,
    PIN_FOR_TRANSACTION) and held again before it ends; ``before_commit`` may
    still refuse the commit (LockLost); nested, it is a savepoint.
    A failure of the session itself is a lost lock (LockLost, its cause chained).
    """
    if handle.pgconn.transaction_status != pq.TransactionStatus.IDLE:
        with handle.transaction():
            yield handle
        return
    try:
        with handle.transaction():
            others = "".join(f",{key}" for key in keys if key != own)
            handle.execute(
                sql.PIN_FOR_TRANSACTION, (f",{own},", f"{others}," if others else "", keys)
            )
            try:
                with handle.transaction():  # a savepoint: the body's work alone
                    yield handle
            finally:
                if handle.pgconn.transaction_status == pq.TransactionStatus.INTRANS:
                    handle.execute(sql.RESTORE_AFTER_TRANSACTION, (keys,))
            before_commit()
    except psycopg.Error as exc:
        if session.closed or not session.alive():
            raise LockLost(
                f"the lock session failed inside the transaction, so its lock is lost: "
                f"{one_line(exc)}"
            ) from exc
        raise


class Source(abc.ABC):
    """Where the sessions of one configuration come from, and how a lock is taken on one."""

    def __init__(self, config: PglockConfig, registry: Registry) -> None:
        self.config = config
        self.registry = registry
        self.monitor: Monitor = registry.monitor
        # Serialises this source's own bookkeeping (never held across a statement).
        self._mutex = threading.Lock()
        #: Every session this source opened and has not closed (a fork closes them).
        self._sessions: set[LockSession] = set()
        #: With pglock_patroni_url: a lock is valid only while its server is confirmed
        #: as the cluster's leader (patroni.py), confirmed afresh before each check
        #: when the last confirmation would not outlast the next one.
        self.fence = LeaderFence.from_setting(config.patroni_url) if config.patroni_url else None
        self._fresh_for = 1.25 * config.check_interval + 3 * (
            self.fence.timeout if self.fence else 0
        )

    def leader_problem(self, session: LockSession | None) -> LeaderProblem | None:
        """Why ``session``'s server is not (or cannot be told to be) the leader, or None.

        Always None without a fence. Asks no statement of the session: a frozen or
        busy session is judged all the same.
        """
        if self.fence is None or session is None:
            return None
        if session.identity is None:
            return LeaderProblem(
                "its server's identity is unknown: the Patroni leader cannot be confirmed"
            )
        verdict = self.fence.confirm(session.identity, fresh_for=self._fresh_for)
        if verdict.valid(for_at_least=self._fresh_for):
            return None
        if verdict.leader:
            return LeaderProblem(
                "its server leads, but a confirmation is trusted for less than a check "
                f"interval and the time to ask ({self._fresh_for:g} s): lower "
                "pglock_check_interval, or raise Patroni's ttl"
            )
        return LeaderProblem(
            f"its server is not confirmed as the Patroni cluster's leader: {verdict.reason}"
        )

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
        problem = self.leader_problem(session)  # first: a busy session is judged too
        if problem is not None:
            return problem
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

    @abc.abstractmethod
    def cut_off(self, hold: Hold, reason: str) -> None:
        """Make a statement under way on ``hold``'s session fail now: its lock is lost.

        Never waits for the session (Hold.mark_lost calls it before telling the body).
        """

    def _cut_if_busy(self, session: LockSession | None) -> None:
        """Cut ``session`` when a statement is under way on it (its guard is taken).

        That statement may wait on a server that will never answer (frozen, deposed).
        """
        if session is None or session.closed or session.pid != os.getpid():
            return
        if session.guard.acquire(blocking=False):
            session.guard.release()
            return  # nothing under way: lost() deals with the session
        session.cut()

    def before_commit(self, hold: Hold) -> None:
        """Refuse the commit of a holder's transaction unless its server still leads."""
        problem = self.leader_problem(hold.session)
        if problem is not None:
            hold.mark_lost(problem)
            raise LockLost(f"lock {hold.label}: the transaction is not committed: {problem}")

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
