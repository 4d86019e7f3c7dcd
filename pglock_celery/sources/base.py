"""The interface between a lock and where its session comes from (see sources/__init__.py)."""

from __future__ import annotations

import abc
import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import psycopg
from psycopg import pq

from .. import sql
from ..config import PglockConfig
from ..dsn import describe_target, without_server
from ..exceptions import LockLost, LockUnavailable
from ..handles import HandleConnection, Revoked, SessionConnection, StatementDeadline
from ..inspect import Holder, holder_on
from ..leader import LeaderSource, Standing, leader_source
from ..loss import Loss, LossKind, lock_gone, session_ended
from ..monitor import Hold, Monitor, one_line
from ..probe import Probe, server_of
from ..session import LockSession, open_session
from ..shield import library_code


class Registry(Protocol):
    """What a source needs of its process's registry (sources/__init__.py)."""

    monitor: Monitor

    def opening(self, config: PglockConfig) -> contextlib.AbstractContextManager[None]: ...


#: The strategies, as pglock_strategy names them.
CONNECT, REUSE, SHARED = "connect", "reuse", "shared"


@contextlib.contextmanager
def fenced_transaction(
    hold: Hold, handle: psycopg.Connection[Any], before_commit: Callable[[], None] | None
) -> Iterator[psycopg.Connection[Any]]:
    """``handle`` inside a transaction that can commit only while its session holds the lock.

    It proves the lock first, without waiting (sql.py, PROVE_AND_PIN): a session
    that no longer holds it raises LockLost at once (the loss is handled whole
    first), and never takes it back. The key stays pinned for the transaction's
    length and is held again before it ends; ``before_commit`` may still refuse
    the commit (LockLost). Nested (in another lock.transaction(), or in a
    transaction the body began itself) it is a savepoint, proven all the same.
    The transaction's own statements are bounded by the statement deadline, the
    body's are not: a COMMIT that waits longer (for synchronous replication, say)
    ends in LockLost saying that whether it committed is unknown. A failure of the
    session itself is a lost lock (LockLost, its cause chained).

    Its own statements go in two round trips (sql.holder_transaction_opening and
    _end), on the session's own connection: the server runs each group back to
    back, and only the last statement of the last group commits, so a session that
    ends anywhere before it commits nothing. With ``before_commit`` (a leader to
    confirm, a previous shard) the COMMIT goes alone, once it has passed.
    """
    session = hold.session
    assert session is not None
    if isinstance(handle.lock, Revoked):
        # Released: refused as every statement through the handle is, whatever the
        # session became since (closed under connect, the next holder's under reuse).
        raise psycopg.OperationalError(handle.lock.message)
    deadline = session.statement_deadline
    proven = committing = False
    try:
        if handle.pgconn.transaction_status != pq.TransactionStatus.IDLE:
            # Nested (in an outer lock.transaction() or the body's own): a savepoint, the
            # lock proven there too (a transaction the body began itself pins nothing).
            with _bounded(handle, deadline), handle.transaction() as savepoint:
                proven = _prove(handle, hold.key, deadline)
                if not proven:
                    raise psycopg.Rollback(savepoint)
                try:
                    with _bounded(handle, None):
                        yield handle
                finally:
                    if handle.pgconn.transaction_status == pq.TransactionStatus.INTRANS:
                        with library_code():
                            handle.execute(sql.RESTORE_AFTER_TRANSACTION, (hold.key,))
        else:
            own = session.conn
            proven = _open(own, handle, hold.key)
            if proven:
                assert isinstance(handle, HandleConnection)
                handle.in_fenced_transaction = True
                try:
                    yield handle
                except BaseException as exc:
                    handle.in_fenced_transaction = False
                    _end_after_failure(own, handle, hold.key)
                    if not isinstance(exc, psycopg.Rollback) or exc.transaction is not None:
                        raise
                    return  # psycopg.Rollback(): the block's work undone, as psycopg does
                handle.in_fenced_transaction = False
                committing = before_commit is None
                _end(own, handle, hold.key, commit=committing)
                if before_commit is not None:
                    with library_code():
                        before_commit()
                    committing = True
                    with library_code(), handle.lock:
                        own.execute(b"COMMIT", prepare=False)
    except StatementDeadline as exc:
        if committing:
            loss = hold.lost or Loss(
                LossKind.CANNOT_TELL,
                f"the server did not answer the COMMIT within {deadline:g} s (waiting for "
                "synchronous replication?): whether the transaction committed is unknown",
            )
        else:
            loss = hold.lost or Loss(
                LossKind.CANNOT_TELL,
                f"the server did not answer the lock transaction's own statement: {one_line(exc)}",
            )
        hold.mark_lost(loss)
        raise LockLost(f"lock {hold.label} was lost: {loss}") from exc
    except psycopg.Error as exc:
        if session.closed or not session.alive():
            loss = hold.lost or session_ended(
                f"the lock session failed inside the transaction: {one_line(exc)}"
            )
            hold.mark_lost(loss)
            raise LockLost(f"lock {hold.label} was lost: {loss}") from exc
        raise
    if not proven:
        loss = lock_gone("the session no longer holds the lock (found as the transaction began)")
        hold.mark_lost(loss)
        raise LockLost(f"lock {hold.label} was lost: {hold.lost or loss}")


def _open(own: psycopg.Connection[Any], handle: psycopg.Connection[Any], key: int) -> bool:
    """Begin the holder's transaction (in ``handle``'s modes), prove and pin ``key``,
    and open the holder's savepoint, in one round trip; whether the key is held (the
    transaction is rolled back when not).

    Every statement of the holder's transaction goes under ``handle.lock``: the
    session's guard while the handle lives, refused once the release revoked it (the
    session may serve another holder by then)."""
    opening = sql.holder_transaction_opening(_begin(handle), key)
    with library_code(), handle.lock:
        try:
            cursor = own.execute(opening, prepare=False)
            cursor.nextset()  # the proof's row
            row = cursor.fetchone()
        except BaseException:
            _roll_back_what_is_open(own)
            raise
        if row is None or row[0] is not True:
            own.execute(b"ROLLBACK", prepare=False)
            return False
    return True


def _end(
    own: psycopg.Connection[Any], handle: psycopg.Connection[Any], key: int, *, commit: bool
) -> None:
    """Out of the holder's savepoint, the key's count restored, and COMMIT with
    ``commit``: one round trip. What a failure leaves open is rolled back."""
    with library_code(), handle.lock:
        try:
            own.execute(sql.holder_transaction_end(key, failed=False, commit=commit), prepare=False)
        except BaseException:
            _roll_back_what_is_open(own)
            raise


def _end_after_failure(
    own: psycopg.Connection[Any], handle: psycopg.Connection[Any], key: int
) -> None:
    """After the holder's block failed: back to its savepoint, the key's count restored,
    and ROLLBACK, in one round trip. A session that fails meanwhile leaves nothing to
    roll back (a revoked handle's, the release rolls back); the block's own error is
    the one that goes on."""
    with library_code(), contextlib.suppress(psycopg.Error), handle.lock:
        if own.pgconn.transaction_status == pq.TransactionStatus.IDLE:
            return  # ended by SQL of the holder's own: nothing is left to end
        try:
            own.execute(sql.holder_transaction_end(key, failed=True, commit=False), prepare=False)
        finally:
            _roll_back_what_is_open(own)


def _roll_back_what_is_open(own: psycopg.Connection[Any]) -> None:
    """ROLLBACK when a transaction is still open (a statement of a group failed, and
    skipped the rest); nothing on a closed or idle session."""
    if not own.closed and own.pgconn.transaction_status in (
        pq.TransactionStatus.INTRANS,
        pq.TransactionStatus.INERROR,
    ):
        with contextlib.suppress(psycopg.Error):
            own.execute(b"ROLLBACK", prepare=False)


def _begin(handle: psycopg.Connection[Any]) -> bytes:
    """BEGIN in ``handle``'s isolation level, read-only and deferrable modes (Django sets
    the level), as psycopg's own transaction() begins."""
    parts = [b"BEGIN"]
    if handle.isolation_level is not None:
        level = psycopg.IsolationLevel(handle.isolation_level).name.replace("_", " ")
        parts.append(b"ISOLATION LEVEL " + level.encode())
    if handle.read_only is not None:
        parts.append(b"READ ONLY" if handle.read_only else b"READ WRITE")
    if handle.deferrable is not None:
        parts.append(b"DEFERRABLE" if handle.deferrable else b"NOT DEFERRABLE")
    return b" ".join(parts)


def _replication_wait(hold: Hold, statement: bytes, bound: float) -> Loss | None:
    """A holder's commit (of the statement that started at ``statement``) waits for
    synchronous replication: a loss once that same statement has waited ``bound``
    seconds since a check first saw it wait (the holder learns; the backend goes on
    waiting, holding the lock, until replication returns or it is ended). Commits
    that each wait a moment are new statements: none adds to another's wait."""
    now = time.monotonic()
    seen = hold.replication_wait_seen
    if seen is None or seen[0] != statement:
        seen = hold.replication_wait_seen = (statement, now)
    waited = now - seen[1]
    if waited < bound:
        return None
    return Loss(
        LossKind.CANNOT_TELL,
        f"a commit of the holder's has waited over {waited:.0f} s for synchronous "
        "replication (the standbys cut off?): whether it committed is unknown",
    )


def _prove(handle: psycopg.Connection[Any], key: int, deadline: float | None) -> bool:
    """Whether the session holds ``key``, proven without waiting and pinned (sql.PROVE_AND_PIN)."""
    with library_code(), _bounded(handle, deadline):
        row = handle.execute(sql.PROVE_AND_PIN, (key, key, key)).fetchone()
    return row is not None and row[0] is True


@contextlib.contextmanager
def _bounded(handle: psycopg.Connection[Any], seconds: float | None) -> Iterator[None]:
    """Let each wait of ``handle`` last at most ``seconds`` (None: no bound) meanwhile.

    The transaction's own statements (BEGIN, the proof, the restore, COMMIT) are the
    library's and bounded; the body's statements inside it are the holder's, and not.
    """
    assert isinstance(handle, SessionConnection)
    before, handle.statement_deadline = handle.statement_deadline, seconds
    try:
        yield
    finally:
        handle.statement_deadline = before


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
        #: The server's view of busy sessions, one probe per server (probe.py).
        self._probes: dict[tuple[str, int, str], Probe] = {}
        #: With a leader source (leader.py): a session takes a lock only on a server
        #: confirmed as the cluster's leader, and a lock is valid only while it stays
        #: confirmed, afresh before each check when the last confirmation would not
        #: outlast the next one.
        self.fence: LeaderSource | None = leader_source(config)

    def confirmed_until(self, hold: Hold) -> float | None:
        """Until when ``hold``'s server is confirmed as the leader (time.monotonic());
        None without a leader source. Read by the monitor without any I/O: a hold whose
        confirmation runs out before a check renews it is lost, however the checks fare."""
        session = hold.session
        return None if self.fence is None or session is None else session.confirmed_until

    def check_interval(self, hold: Hold) -> float:
        """Seconds between checks of ``hold``: pglock_check_interval, or less under the
        fence when the cluster's timing needs it, so that every check finds a
        confirmation that outlasts the next one."""
        wanted = hold.config.check_interval
        return wanted if self.fence is None else self.fence.check_interval(wanted)

    def _fresh_for(self) -> float:
        """How long a confirmation must last: until the next check (within 1.25 check
        intervals, as the cluster's timing sets them) and the time to ask then."""
        assert self.fence is not None
        interval = self.fence.check_interval(self.config.check_interval)
        return 1.25 * interval + self.fence.longest_ask

    def leader_problem(self, session: LockSession | None) -> Loss | None:
        """Why ``session``'s server is not (or cannot be told to be) the leader, or None.

        Always None without a fence. Asks no statement of the session: a frozen or
        busy session is judged all the same.
        """
        if self.fence is None or session is None:
            return None
        if session.identity is None:
            return Loss(
                LossKind.CANNOT_TELL,
                f"its server's identity is unknown: {self.fence.name}'s leader cannot be confirmed",
            )
        verdict = self.fence.confirm(session.identity, fresh_for=self._fresh_for())
        # Asked again once the answer is in: the first one reads the cluster's timing.
        fresh_for = self._fresh_for()
        if verdict.valid(for_at_least=fresh_for):
            session.confirmed_until = verdict.until  # what the monitor holds it to
            return None
        if verdict.leader:
            return Loss(
                LossKind.CANNOT_TELL,
                "its server leads, but a confirmation is trusted for less than a check "
                f"interval and the time to ask ({fresh_for:g} s): the cluster's timing "
                "leaves too short a window (pglock-celery doctor says what to change)",
            )
        kind = (
            LossKind.NOT_LEADER
            if verdict.standing is Standing.NOT_LEADER
            else (LossKind.CANNOT_TELL)
        )
        return Loss(
            kind, f"its server is not confirmed as {self.fence.name}'s leader: {verdict.reason}"
        )

    def open_on_leader(self, app_name: str) -> LockSession:
        """Open a session, on the cluster's leader when a leader source is configured.

        Fence first: a session whose server is not confirmed as the leader takes no
        lock. It is closed, and the DSN's next hosts are tried in their order (libpq
        picks the first that accepts, so a deposed or rogue primary early in the list
        would otherwise keep every lock from the leader behind it); LockUnavailable,
        with each server's reason, when none is confirmed. Call it inside the
        registry's ``opening()``.
        """
        if self.fence is None:
            return open_session(self.config, app_name)
        config, refused = self.config, list[str]()
        while True:
            try:
                session = open_session(config, app_name, self.fence.identify)
            except LockUnavailable as exc:
                if not refused:
                    raise
                raise self._no_leader([*refused, str(exc)]) from exc
            try:
                loss = self.leader_problem(session)
            except BaseException:
                session.close()
                raise
            if loss is None:
                return session
            host, port = session.conn.info.host, session.conn.info.port
            session.close()
            refused.append(f"{host}:{port}: {loss}")
            rest = without_server(config.require_dsn(), host, port)
            if rest is None:
                raise self._no_leader(refused)
            config = config.with_dsn(rest)

    def _no_leader(self, refused: list[str]) -> LockUnavailable:
        assert self.fence is not None
        return LockUnavailable(
            f"no server of {describe_target(self.config.require_dsn())} is confirmed as "
            f"{self.fence.name}'s leader, so no lock is taken: " + "; ".join(refused)
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
    def transaction(
        self, hold: Hold, also_held: Callable[[], None] | None = None
    ) -> contextlib.AbstractContextManager[psycopg.Connection[Any]]:
        """A connection inside a transaction that can commit only while the lock is held
        (and ``also_held``, called just before the commit, raises no LockLost)."""

    @abc.abstractmethod
    def end_use(self, hold: Hold, loss: Loss) -> None:
        """End the holder's use of its session after ``loss``, never waiting for it.

        Called once per loss by Hold.mark_lost, before the holder is told: after it,
        no statement of that holder reaches the server.
        """

    @abc.abstractmethod
    def close(self) -> None:
        """Close every session that holds nothing (idle sessions, quiet shared ones, probes)."""

    def check(self, hold: Hold) -> Loss | None:
        """Return how ``hold``'s lock is lost, or None while held (or when it cannot tell yet).

        The leader first (no statement: a busy or frozen session is judged too).
        Then a session between statements is asked itself, under its guard; a
        busy one (its guard in use by another thread, or a holder's pipeline, COPY
        or transaction, a wait for the lock) is judged from outside, never waited
        for: its socket, then the server's own view (probe.py).
        """
        session = hold.session
        loss = self.leader_problem(session)
        if loss is not None or session is None:
            return loss
        if hold.lost is not None or hold.ended:
            return hold.lost
        if session.closed:
            return session_ended("the lock session failed: it is closed")
        if session.guard.acquire(blocking=False):
            try:
                if (
                    session.pgconn.transaction_status == pq.TransactionStatus.IDLE
                    and not session.pgconn.pipeline_status
                ):
                    hold.replication_wait_seen = None  # between statements: no commit waits
                    return self._ask(session, hold)
            finally:
                session.guard.release()
        return self._judge_busy(session, hold)

    def _ask(self, session: LockSession, hold: Hold) -> Loss | None:
        """Ask a session between statements whether it holds ``hold``'s lock."""
        try:
            result = session.query(*sql.CHECK, (str(hold.key).encode(),))
        except psycopg.Error as exc:
            return session_ended(f"the lock session failed: {one_line(exc)}")
        if result.get_value(0, 0) == b"t":
            return Loss(LossKind.NOT_LEADER, "the server is in recovery (a failover?)")
        if result.get_value(0, 1) != b"t":
            return lock_gone("the session no longer holds the lock")
        return None

    def _judge_busy(self, session: LockSession, hold: Hold) -> Loss | None:
        """Judge a session that cannot be asked now: its socket, then the server's view."""
        if not session.alive():
            return session_ended("the lock session failed: the server closed it")
        if session.pid != os.getpid() or session.backend_started is None:
            return None  # a parent's session; behind a pooler the server's view is not ours
        loss, waiting = self._probe(session).judge(session, hold.key if hold.granted else None)
        if loss is not None or waiting is None:
            hold.replication_wait_seen = None
            return loss
        return _replication_wait(hold, waiting, session.statement_deadline)

    def _probe(self, session: LockSession) -> Probe:
        where = server_of(session)
        with self._mutex:
            probe = self._probes.get(where)
            if probe is None:
                probe = self._probes[where] = Probe(self.config, *where, self.registry.opening)
        return probe

    def close_probes(self) -> None:
        with self._mutex:
            probes, self._probes = list(self._probes.values()), {}
        for probe in probes:
            probe.close()

    def before_commit(self, hold: Hold) -> None:
        """Refuse the commit of a holder's transaction unless its server still leads."""
        loss = self.leader_problem(hold.session)
        if loss is not None:
            hold.mark_lost(loss)
            raise LockLost(f"lock {hold.label}: the transaction is not committed: {loss}")

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
        if self.fence is not None:
            self.fence.after_fork_in_child()
        inherited = list(self._sessions)
        self._sessions.clear()
        for session in inherited:
            session.forget_after_fork()
        for probe in self._probes.values():
            probe.forget_after_fork()
        self._probes = {}
        return inherited
