"""The psycopg connections over a lock session's socket: the library's own, and holders' handles.

Both wait cooperatively under gevent and eventlet.

A holder's handle is a fresh psycopg connection over its lock session's socket,
so every client-side attribute starts at its default. At release (or when the
holder closes it) the handle is revoked: its lock is replaced by one that refuses
every statement, and its libpq connection by one that never connected, so every
statement through it, or through a cursor made from it, fails from then on.
"""

from __future__ import annotations

import functools
import sys
import threading
import time
from collections.abc import Callable, Generator
from types import TracebackType
from typing import Any

import psycopg
from psycopg import pq, waiting

from .shield import library_code


def _green_select() -> str | None:
    """Which green library made ``select`` cooperative since psycopg was imported, if any.

    psycopg picks its wait function once, at import, and only knows gevent.
    """
    try:
        eventlet = sys.modules.get("eventlet.patcher")
        if eventlet is not None and eventlet.is_monkey_patched("select"):
            return "eventlet"
        gevent = sys.modules.get("gevent.monkey")
        if gevent is not None and gevent.is_module_patched("select"):
            return "gevent"
    except Exception:
        return None
    return None


def green_wait() -> Callable[..., Any] | None:
    """psycopg's wait function for the green library in use, if any (else None)."""
    green = _green_select()
    if green == "gevent" and hasattr(waiting, "wait_poll"):
        # wait_c polls in C, out of the hub's reach: it would block every green
        # thread. gevent makes poll() cooperative, which takes descriptors past 1023.
        return waiting.wait_poll
    return waiting.wait_select if green else None


def finish_interrupted(
    conn: psycopg.Connection[Any], gen: Generator[Any, Any, Any], wait: Callable[..., Any]
) -> Any:
    """Cancel a statement whose wait was interrupted and read its end; return its results.

    The session is then idle again (or in a failed transaction); when that cannot
    be reached within bounds, its connection is closed (None). psycopg does this
    itself for KeyboardInterrupt only.
    """
    if conn.pgconn.transaction_status != pq.TransactionStatus.ACTIVE:
        return None
    try:
        conn.cancel_safe(timeout=CANCEL_WAIT)
        return wait(gen, conn.pgconn.socket, interval=0.1)
    except psycopg.errors.QueryCanceled:
        return None
    except BaseException:
        conn.pgconn.finish()  # interrupted again, or the server did not stop: unknown state
        return None


#: Seconds a cancelled statement is given to end before its connection is closed.
CANCEL_WAIT = 5.0


class SessionGuard:
    """A lock session's re-entrant guard: every statement on the session, whoever sends
    it (the library, a holder's handle), runs holding it.

    Once the session is retired (:meth:`close_when_quiet`), whoever lets go of it last
    closes the session's connection, still holding it: a session found lost while a
    statement was under way is closed as that statement ends, by the library, never
    left open for the garbage collector, and never closed under another thread's wait
    (which could hand its descriptor's number to another file).
    """

    def __init__(self) -> None:
        self._lock = threading.RLock()
        # How deep the owner holds it (only the owner changes it).
        self._depth = 0
        self._on_quiet: Callable[[], None] | None = None
        # Makes "the last let-go finds no close asked for, and lets go" one step against
        # close_when_quiet's "asked for, and found it held": never both missed.
        self._state = threading.Lock()

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        got = self._lock.acquire(blocking, timeout)
        if got:
            self._depth += 1
        return got

    def release(self) -> None:
        with self._state:
            close = None
            if self._depth == 1:
                close, self._on_quiet = self._on_quiet, None
            if close is None:
                self._depth -= 1
                self._lock.release()
                return
        try:
            close()  # still holding it: nobody else's statement can be under way
        finally:
            with self._state:
                self._depth -= 1
                self._lock.release()

    __enter__ = acquire  # one frame fewer on every statement

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()

    def close_when_quiet(self, close: Callable[[], None], *, now_if_idle: bool = True) -> None:
        """Run ``close`` as the statement under way ends; with none under way, now (or,
        without ``now_if_idle``, not at all: the caller closes it later)."""
        with self._state:
            if self._depth or not self._lock.acquire(blocking=False):
                self._on_quiet = close  # held (by this thread too): its last let-go closes
                return
            if not now_if_idle:
                self._lock.release()
                return
            self._on_quiet = close
            self._depth += 1
        self.release()


class StatementDeadline(psycopg.OperationalError):
    """A statement of the library's got no answer within its deadline: the server is
    frozen or gone, and the session is not used again."""


class SessionConnection(psycopg.Connection[Any]):
    """A psycopg connection whose waits yield to gevent's or eventlet's hub when in use.

    The library's own connection on a session waits at most ``statement_deadline``
    seconds for the server (a holder's handle has no such bound: its statements
    may legitimately run long).
    """

    #: Seconds any one wait may last (None: no bound).
    statement_deadline: float | None = None

    def wait(
        self,
        gen: Generator[Any, Any, Any],
        interval: float = 0.1,
        timeout: float | None = None,
    ) -> Any:
        ours = timeout is None and self.statement_deadline is not None
        if ours:
            timeout = self.statement_deadline
        green = green_wait()
        started = time.monotonic()
        # A lost lock's interrupt waits until the statement is over: the session is cut
        # first (monitor.Hold.mark_lost), so the statement ends at once all the same.
        with library_code():
            try:
                if green is not None:
                    return green(gen, self.pgconn.socket, interval=interval, timeout=timeout)
                return super().wait(gen, interval, timeout)
            except psycopg.Error as exc:
                if ours and timeout is not None and time.monotonic() - started >= timeout:
                    # The library's deadline, not a caller's timeout (notifies(), ...).
                    raise StatementDeadline(
                        f"the server did not answer within {timeout:g} s"
                    ) from exc
                raise
            except BaseException:
                # A time limit (SoftTimeLimitExceeded, gevent.Timeout) cut the wait: the
                # statement would run on and leave the session busy for everyone on it.
                finish_interrupted(self, gen, green or waiting.wait)
                raise


class HandleConnection(SessionConnection):
    """A holder's handle: closing it (``with conn:``) revokes it, never the session.

    Its libpq connection is the session's own, which revoking cannot take back
    from code that kept it (``conn.info.pgconn``, a cursor): a session whose
    libpq connection is still referred to after release is closed instead of
    serving another holder (session.LockSession.referenced_elsewhere), so what was
    kept finds it closed.
    """

    #: Revokes this handle with a message (set by the session that made it).
    on_close: Callable[[psycopg.Connection[Any], str], None]
    #: While lock.transaction() is open on it (sources/base.py): its commit is the
    #: block's, once the lock is proven again.
    in_fenced_transaction = False

    def commit(self) -> None:
        self._refuse_inside_the_lock_transaction("commit")
        super().commit()

    def rollback(self) -> None:
        self._refuse_inside_the_lock_transaction("rollback")
        super().rollback()

    def _refuse_inside_the_lock_transaction(self, what: str) -> None:
        """As psycopg refuses them inside its own transaction() block."""
        if self.in_fenced_transaction:
            raise psycopg.ProgrammingError(
                f"explicit {what}() forbidden inside lock.transaction(): the block commits "
                "as it ends, once the lock is proven again (raise psycopg.Rollback() or "
                "an exception to roll it back)"
            )

    def close(self) -> None:
        if not self.closed:
            self.on_close(self, "this handle of the lock connection was closed")


class Revoked:
    """Stands in for a released handle's lock: every statement through it fails."""

    def __init__(self, message: str) -> None:
        self.message = message

    def __enter__(self) -> None:
        raise psycopg.OperationalError(self.message)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        return None

    def acquire(self, *args: Any, **kwargs: Any) -> bool:
        raise psycopg.OperationalError(self.message)

    def release(self) -> None:
        return None

    def locked(self) -> bool:
        return False


@functools.lru_cache(maxsize=1)
def dead_pgconn() -> pq.abc.PGconn:
    """A libpq connection that never connected: a revoked handle's, so it reads closed."""
    return pq.PGconn.connect_start(b"pglock_released=1")
