"""Strategies ``connect`` and ``reuse``: a session to itself for every holder.

Session-level advisory locks are re-entrant within a session, so two holders
must never share one. ``connect`` opens a session for each lock and closes it
at release. ``reuse`` keeps up to ``pglock_idle_sessions`` idle sessions per
process and configuration: a session is taken by one holder at a time and goes
back only after a clean unlock (a holder that had a handle is reset with
``DISCARD ALL`` first: its server-side state back to the session's start), and
only when nothing of the holder's still refers to its libpq connection; any
doubt closes it. A session whose lock was found lost is cut at once and never
used again. An idle session found ended by the server is closed before
use; a lock statement is never retried on another session without the caller
knowing.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from typing import Any

import psycopg
from psycopg import errors as pg_errors
from psycopg.pq import TransactionStatus

from .. import sql
from ..config import PglockConfig
from ..exceptions import LockLost, LockTimeout, LockUnavailable, PglockError
from ..loss import Loss, LossKind, lock_gone, session_ended
from ..monitor import Hold, one_line
from ..session import LockSession, idle_name, stamped
from .base import REUSE, Registry, Source, fenced_transaction


class DedicatedSource(Source):
    """Sessions opened per lock (``connect``) or kept idle between locks (``reuse``)."""

    def __init__(self, config: PglockConfig, registry: Registry) -> None:
        super().__init__(config, registry)
        self.reuse = config.strategy == REUSE
        self._idle: list[LockSession] = []
        self._idle_name = idle_name(config.application_name)

    # -- acquire ---------------------------------------------------------------------

    def acquire(self, hold: Hold, *, wait: bool, timeout: float | None) -> bool:
        """Try first, then wait if asked: a wait starts only on a session that answered.

        An idle session can have been ended by the server since its last use (a
        restart, a DBA): when the try fails on such a session, it held nothing, and
        the try goes to a new session (no socket peek first: the try is the proof,
        and costs nothing more). Once a wait has started, its failure is the
        caller's (LockUnavailable). Under a leader source, a session takes nothing on
        a server not confirmed as the leader: an idle one is closed, a new one goes on
        to the DSN's next hosts (Source.open_on_leader).
        """
        with self._mutex:
            session = self._idle.pop() if self._idle else None
        if session is not None and self.leader_problem(session) is not None:
            self._discard(session)  # fence first: an idle session off the leader takes nothing
            session = None
        fresh = session is None
        if session is None:
            session = self._open(hold)
        try:
            try:
                granted = self._try(session, hold)
            except psycopg.Error:
                if fresh:
                    raise
                self._discard(session)
                session = self._open(hold)
                granted = self._try(session, hold)
            hold.session = session
            if not granted and wait:
                granted = self._wait(session, hold, timeout)
        except psycopg.Error as exc:
            self._discard(session)
            raise LockUnavailable(
                f"lock {hold.label}: the lock session failed while locking: {one_line(exc)}"
            ) from exc
        except BaseException:
            self._discard(session)
            raise
        hold.granted = granted
        return granted

    def _open(self, hold: Hold) -> LockSession:
        # Under reuse a session outlives its holder: it starts under the idle name.
        name = self._idle_name if self.reuse else hold.application_name
        with self.registry.opening(self.config):
            session = self.open_on_leader(name)
            self._register(session)
        return session

    def _try(self, session: LockSession, hold: Hold) -> bool:
        key = str(hold.key).encode()
        params = (
            stamped(hold.application_name, session),
            b"," + key + b",",
            session.token.encode(),
            key,
        )
        result = session.query(*sql.TRY, params)
        got = result.get_value(0, 0)
        backend_pid = result.get_value(0, 1)
        if got is None or backend_pid is None or int(backend_pid) != session.backend_pid:
            raise _moved(session, hold.label, backend_pid)
        return got == b"t"

    def _wait(self, session: LockSession, hold: Hold, timeout: float | None) -> bool:
        """Wait on the session for the lock, watched meanwhile like a held lock.

        The wait itself has no deadline but the caller's timeout; the monitor judges
        the waiting session from outside every check interval (probe.py), and a
        server that stops answering, or that another server replaced, or one the
        fence refuses, cuts the wait short (LockUnavailable).
        """
        self.monitor.watch(hold)
        try:
            return self._wait_watched(session, hold, timeout)
        except psycopg.Error as exc:
            if hold.lost is not None:
                raise LockUnavailable(
                    f"lock {hold.label}: the wait was cut short: {hold.lost}"
                ) from exc
            raise
        finally:
            self.monitor.unwatch(hold)

    def _wait_watched(self, session: LockSession, hold: Hold, timeout: float | None) -> bool:
        key = str(hold.key).encode()
        with session.guard:
            restore = None
            if timeout is not None:
                # lock_timeout = 0 means "forever" to Postgres: wait at least 1 ms.
                bound = b"%dms" % max(1, round(timeout * 1000))
                restore = session.query(*sql.SET_WAIT_BOUND, (bound,)).get_value(0, 0)
            try:
                # A wait has no deadline of the library's beyond the caller's timeout.
                within = None if timeout is None else timeout + session.statement_deadline
                waited = session.query(*sql.WAIT, (session.token.encode(), key), deadline=within)
            except pg_errors.LockNotAvailable:
                spent = f"within {timeout:g} s" if timeout is not None else "(lock_timeout)"
                raise LockTimeout(f"lock {hold.label} not obtained {spent}") from None
            if waited.get_value(0, 0) is None:
                raise _moved(session, hold.label, None)
            params = (stamped(hold.application_name, session), b"," + key + b",", restore, key)
            result = session.query(*sql.AFTER_WAIT, params)
        backend_pid = result.get_value(0, 0)
        if backend_pid is None or int(backend_pid) != session.backend_pid:
            raise _moved(session, hold.label, backend_pid)
        return True

    # -- release ---------------------------------------------------------------------

    def release(self, hold: Hold, *, clean: bool) -> None:
        session = hold.session
        if session is None:
            return
        keep = False
        try:
            if not hold.granted:
                keep = clean and hold.lost is None  # nothing was taken on this session
                return
            if hold.lost is not None:
                # Its session was cut when the loss was found: it serves nobody again.
                session.revoke(f"lock {hold.label} was lost: this connection is closed")
                raise LockLost(f"lock {hold.label} was lost while held: {hold.lost}")
            keep = self._unlock(session, hold, reset=clean) and clean
        finally:
            # Kept idle for a later lock only when nothing is in doubt and there is room.
            kept = False
            if (
                keep
                and self.reuse
                and not session.pooled
                and session.pid == os.getpid()
                and not session.referenced_elsewhere()
            ):
                with self._mutex:
                    kept = len(self._idle) < self.config.idle_sessions
                    if kept:
                        session.handed_out = False
                        self._idle.append(session)
            if not kept:
                self._discard(session)

    def _unlock(self, session: LockSession, hold: Hold, *, reset: bool) -> bool:
        """Unlock and wait for it; whether the session may be used again, or LockLost.

        With ``reset``, a session that may be kept and was handed out is reset too
        (DISCARD ALL, in the same round trip): what its holder left goes with the lock.

        A session that a statement still keeps busy (another thread's, one sent
        around the library, an open pipeline) cannot run the unlock: its backend
        is ended from outside instead, and the release returns once the server
        confirms it gone (a release is a release), never waiting for that
        statement longer than the statement deadline.
        """
        label = hold.label
        if session.handed_out:
            session.revoke(f"lock {label} was released: this connection is closed")
        clean = True
        key = str(hold.key).encode()
        deadline = session.statement_deadline
        if not session.guard.acquire(timeout=deadline):
            return self._end_busy(session, hold)
        try:
            status = session.pgconn.transaction_status
            if status == TransactionStatus.ACTIVE or session.pgconn.pipeline_status:
                return self._end_busy(session, hold)
            if status not in (TransactionStatus.IDLE, TransactionStatus.UNKNOWN):
                session.conn.rollback()  # made under the lock: it must not outlive it
                clean = False
            if self.reuse and clean and reset and session.handed_out:
                params = (key, self._idle_name.encode())
                unlocked, clean = session.unlock_and_reset(sql.UNLOCK_FOR_REUSE[1], params)
            elif self.reuse:
                params = (key, self._idle_name.encode())
                unlocked = session.query(*sql.UNLOCK_FOR_REUSE, params).get_value(0, 0)
            else:
                unlocked = session.query(*sql.UNLOCK, (key,)).get_value(0, 0)
        except psycopg.Error as exc:
            self.monitor.found_at_release(
                hold, session_ended(f"the lock session failed at release: {one_line(exc)}")
            )
            raise LockLost(
                f"lock {label}: the session failed at release, so the lock "
                f"was lost before it: {one_line(exc)}"
            ) from exc
        finally:
            session.guard.release()
        if unlocked != b"t":
            self.monitor.found_at_release(
                hold, lock_gone("the session no longer held the lock at release")
            )
            raise LockLost(f"lock {label} was no longer held at release")
        return clean

    def _end_busy(self, session: LockSession, hold: Hold) -> bool:
        """Release a session a statement keeps busy: cut it, end its backend, wait for that.

        Returns False (the session is not used again) once the server confirms
        the backend gone; raises LockLost when it does not within the deadline:
        the lock may then stay held until the server notices the cut connection.
        """
        session.cut()
        deadline = session.statement_deadline
        if session.backend_started is not None and self._probe(session).end_backend(
            session, deadline
        ):
            return False
        self.monitor.found_at_release(
            hold,
            Loss(
                LossKind.CANNOT_TELL,
                "a statement kept the session busy at release, and the server did not "
                "confirm that it ended the session",
            ),
        )
        raise LockLost(
            f"lock {hold.label}: a statement kept its session busy at release, and the "
            f"server did not confirm within {deadline:g} s that it ended the session"
        )

    # -- what a holder touches ---------------------------------------------------------

    def connection(self, hold: Hold) -> psycopg.Connection[Any]:
        session = hold.session
        assert session is not None
        with session.guard:
            if hold.ended:
                raise LockLost(f"lock {hold.label} was released: it has no connection")
            if hold.lost is not None:
                raise LockLost(f"lock {hold.label} was lost: {hold.lost}")
            if hold.handle is None or hold.handle.closed:
                if session.closed or not session.alive():
                    loss = session_ended("the lock session failed: the server closed it")
                    hold.mark_lost(loss)
                    raise LockLost(f"lock {hold.label} was lost: {hold.lost or loss}")
                hold.handle = session.handle()
            return hold.handle

    def transaction(
        self, hold: Hold, also_held: Callable[[], None] | None = None
    ) -> contextlib.AbstractContextManager[psycopg.Connection[Any]]:
        def before_commit() -> None:
            if also_held is not None:
                also_held()
            self.before_commit(hold)

        # Nothing to ask before the COMMIT: it goes with the transaction's end.
        asks = also_held is not None or self.fence is not None
        return fenced_transaction(hold, self.connection(hold), before_commit if asks else None)

    def end_use(self, hold: Hold, loss: Loss) -> None:
        """Cut the session: it is the holder's alone, and no statement of its may follow.

        A statement under way fails at once on the client, even on a server that
        will never answer it; nothing more reaches the server, which ends the
        backend (and rolls back its transaction) as it reads the end of the
        connection. A backend still running a statement of the holder's on a
        session that lost its lock while alive is ended from outside too, and
        waited for, so that statement commits nothing after the loss was found.
        """
        session = hold.session
        if session is None or session.pid != os.getpid():
            return
        busy = (
            session.guard_is_taken()
            or bool(session.pgconn.pipeline_status)
            or session.pgconn.transaction_status == TransactionStatus.ACTIVE
        )
        session.cut()
        if busy and loss.kind is LossKind.LOCK_GONE and session.backend_started is not None:
            deadline = session.statement_deadline
            self._probe(session).end_backend(session, deadline)
        # Closed as the holder's statement under way ends; an idle one at release, not
        # now: psycopg skips the COMMIT of a closed connection without a word, and a
        # holder's transaction() block must see its COMMIT fail.
        session.retire(now_if_idle=False)

    def close(self) -> None:
        with self._mutex:
            idle, self._idle = self._idle, []
        for session in idle:
            self._discard(session)
        self.close_probes()

    def idle_count(self) -> int:
        """Idle sessions kept (for tests and benchmarks)."""
        with self._mutex:
            return len(self._idle)

    def after_fork_in_child(self) -> list[LockSession]:
        self._idle = []
        return super().after_fork_in_child()


def _moved(session: LockSession, label: str, backend_pid: bytes | None) -> PglockError:
    """The error for a lock statement that did not run on the session's own backend."""
    ran_on = backend_pid.decode() if backend_pid else "another"
    return LockUnavailable(
        f"lock {label}: the lock statement did not run on the session's own "
        f"backend {session.backend_pid} (it ran on {ran_on}, without this session's "
        "token, or with an earlier holder's lock): a pooler moved the session, so it "
        "fails closed"
    )
