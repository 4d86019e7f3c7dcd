"""Loss detection: each hold of a lock, and the threads that watch it.

A hold is a lock's session from grant to release, with its own loss state, so
nothing of an earlier hold (a released one, one on a session that died while
cached) can leave a later one unwatched. While a hold lasts past one check
interval, a monitor thread (started by scheduler.py) checks its session
whenever no statement runs on it, atomically with respect to the holder (both
go through the session's guard).
Between transactions it asks the server (alive, still holding the lock, a
primary); inside the body's transaction it peeks at the socket only, which
tells when the server ended the session, without disturbing the transaction.
A loss is logged, marks the hold lost and is handed to the holder's loss handler.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import psycopg
from psycopg.pq import TransactionStatus

from .config import PglockConfig
from .lock_session import LockSession

logger = logging.getLogger("pglock_celery.lock")

# One round trip, O(1) whatever the number of locks on the server: is the server a
# primary, and does this session still hold the key? A held lock's count is 2 (see
# lock.py): unlocking it once and taking it again never lets it go; a lock the
# session no longer holds is not unlocked (false, with a warning) and not taken.
_CHECK = (
    b"pglock_check",
    b"SELECT pg_is_in_recovery(),"
    b" CASE WHEN pg_advisory_unlock($1::int8) THEN pg_try_advisory_lock($1::int8) END",
)


def one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())


class Hold:
    """One holding of a lock, from its grant to its release: what the monitor watches.

    It never refers to its AdvisoryLock, so a lock dropped without release
    can be collected, and its finalizer frees the session.
    """

    def __init__(
        self,
        session: LockSession,
        *,
        key: int,
        label: str,
        application_name: str,
        task_id: str | None,
        config: PglockConfig,
        on_lost: LossHandler | None,
    ) -> None:
        self.session = session
        self.key = key
        self.label = label
        self.application_name = application_name
        self.task_id = task_id
        self.config = config
        self.on_lost = on_lost
        self.since = time.monotonic()
        #: Why the lock was found lost, or None.
        self.lost: str | None = None
        # Set at release or loss; made only when someone waits (most holds end unwatched).
        self._changed: threading.Event | None = None
        self.ended = False
        #: Whether the loss was found only after the release returned (see protocol.py).
        self.lost_after_release = False
        self.handle: psycopg.Connection[Any] | None = None

    def end(self) -> None:
        self.ended = True
        self._signal()

    def _signal(self) -> None:
        changed = self._changed
        if changed is not None:
            changed.set()

    def wait(self, seconds: float) -> bool:
        """Wait up to ``seconds`` for the release or a loss; whether one came."""
        changed = self._changed
        if changed is None:
            with _events_lock:
                if self._changed is None:
                    self._changed = threading.Event()
                changed = self._changed
        if self.ended or self.lost is not None:
            return True  # came before the event was there to be set
        return changed.wait(seconds)

    def check(self, *, wait: bool) -> str | None:
        """Return why the lock is lost, or None while it is held (or cannot be asked).

        Runs under the session's guard, so no statement of the holder can start
        in between; with ``wait`` False it gives up at once when one is running
        (the holder will see any failure of the session itself).
        """
        session = self.session
        if not session.guard.acquire(blocking=wait):
            return None
        try:
            if self.ended or self.lost is not None:
                return self.lost
            if session.pgconn.pipeline_status:
                return None  # results of the holder's pipeline are on their way
            status = session.pgconn.transaction_status
            if status == TransactionStatus.IDLE:
                try:
                    result = session.query(*_CHECK, (str(self.key).encode(),))
                except psycopg.Error as exc:
                    return f"the lock session failed: {one_line(exc)}"
                if result.get_value(0, 0) == b"t":
                    return "the server is in recovery (a failover?)"
                if result.get_value(0, 1) != b"t":
                    return "the session no longer holds the lock"
                return None
            if status in (TransactionStatus.INTRANS, TransactionStatus.INERROR):
                if not session.alive():
                    return "the lock session failed: the server closed it"
                return None
            if session.closed:
                return "the lock session failed: it is closed"
            return None  # a statement of the holder's is under way
        finally:
            session.guard.release()

    def mark_lost(self, reason: str) -> None:
        """Record a loss once: log it, end a session that lives on without the lock, tell."""
        session = self.session
        with session.guard:
            if self.lost is not None or self.ended:
                return
            self.lost = reason
            self._signal()
            with _losses_lock:
                losses["while_held"] += 1
            failed = "session failed" in reason
            if not session.closed and not failed and not session.shared:
                # Alive but without the lock (or on a standby): end the session,
                # so that no further write of this holder can commit.
                with contextlib.suppress(psycopg.Error):
                    session.conn.execute("SELECT pg_terminate_backend(pg_backend_pid())")
        self._log_loss("lock %s lost by %s (task %s): %s", reason)
        if self.on_lost is not None:
            self.on_lost(self, reason)
        if failed and session.on_failure is not None:
            session.on_failure(reason)

    def _log_loss(self, message: str, reason: str) -> None:
        """Log a loss at error level: ``message`` takes the label, holder, task id, reason."""
        logger.error(
            message,
            self.label,
            self.application_name,
            self.task_id,
            reason,
            extra={
                "lock": self.label,
                "key": self.key,
                "task_id": self.task_id,
                "holder": self.application_name,
                "reason": reason,
            },
        )

    def count_lost_at_release(self) -> None:
        with _losses_lock:
            losses["at_release"] += 1

    def lost_at_release(self, reason: str) -> None:
        """Report a loss found after the release returned (its unlock was not waited for)."""
        self.lost = self.lost or reason
        self.lost_after_release = True
        self.count_lost_at_release()
        self._log_loss("lock %s was lost before its release by %s (task %s): %s", reason)
        if self.on_lost is not None:
            try:
                self.on_lost(self, reason)
            except Exception:
                logger.exception("lock %s: reporting its loss failed", self.label)

    def monitor(self) -> None:
        """Check the session every check interval until release or loss."""
        while not self.ended and self.lost is None:
            try:
                reason = self.check(wait=False)
                if reason is not None:
                    self.mark_lost(reason)
                    return
            except Exception:
                logger.exception("lock %s: the loss check failed", self.label)
            if self.wait(self.config.check_interval):
                return


#: Locks this process found lost: while held (the monitor, held()), and at release.
losses = {"while_held": 0, "at_release": 0}
_losses_lock = threading.Lock()
_events_lock = threading.Lock()


def _new_locks() -> None:
    # In a forked child a thread that held one of them is gone.
    global _losses_lock, _events_lock
    _losses_lock, _events_lock = threading.Lock(), threading.Lock()


os.register_at_fork(after_in_child=_new_locks)

#: Called from the monitor thread when a held lock is found lost.
LossHandler = Callable[[Hold, str], None]
