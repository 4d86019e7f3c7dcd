"""Where lock sessions come from: a new one per lock, or this process's idle ones.

A :class:`LockSession` is one dedicated libpq connection. The library talks to
it through a private psycopg connection that no holder ever sees; a holder
gets a handle of its own (:meth:`LockSession.handle`), a fresh psycopg
connection over the same socket, so every client-side attribute starts at its
default. At release every handle is revoked: each statement through it, or
through a cursor made from it, fails from then on. One re-entrant lock per
session serialises the handles, the library's statements and the monitor.

Strategy ``connect`` opens a session for each lock and closes it on release.
Strategy ``reuse`` keeps a few idle sessions per process and DSN: a session is
checked out by one holder at a time and goes back only after a clean unlock;
a session a holder had a handle to is reset with ``DISCARD ALL`` first (its
server-side state back to the session's start); any doubt closes it.

A forked child must neither use nor close its parent's sessions: after a fork
the child closes its copies of every session's socket (so only the parent's
own life decides when they end) and keeps the objects unfinalized, so that
libpq never writes a goodbye on a descriptor number that may be reused.
"""

from __future__ import annotations

import contextlib
import functools
import os
import socket
import sys
import threading
from collections.abc import Generator, Iterator
from types import TracebackType
from typing import Any

import psycopg
from psycopg import pq, waiting

from .config import PglockConfig

CONNECT, REUSE = "connect", "reuse"

#: How much of what the server sent unasked is looked at (a notice or two, an error).
_PEEK_BYTES = 8192
#: The protocol's ErrorResponse: unasked, it is the server ending the session.
_ERROR_MESSAGE = b"E"


def _green_select() -> bool:
    """Whether eventlet or gevent made ``select`` cooperative since psycopg was imported.

    psycopg picks its wait function once, at import, and only knows gevent.
    """
    try:
        eventlet = sys.modules.get("eventlet.patcher")
        if eventlet is not None and eventlet.is_monkey_patched("select"):
            return True
        gevent = sys.modules.get("gevent.monkey")
        return bool(gevent is not None and gevent.is_module_patched("select"))
    except Exception:
        return False


class SessionConnection(psycopg.Connection[Any]):
    """A psycopg connection whose waits yield to eventlet's hub when it is in use."""

    def wait(
        self,
        gen: Generator[Any, Any, Any],
        interval: float = 0.1,
        timeout: float | None = None,
    ) -> Any:
        if _green_select():
            # wait_c polls in C, out of the hub's reach: it would block every green thread.
            return waiting.wait_select(gen, self.pgconn.socket, interval=interval)
        return super().wait(gen, interval, timeout)


class HandleConnection(SessionConnection):
    """A holder's handle: closing it (``with conn:``) revokes it, never the session."""

    session: LockSession

    def close(self) -> None:
        if not self.closed:
            self.session.revoke_one(self, "this handle of the lock connection was closed")


class _Revoked:
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
def _dead_pgconn() -> pq.abc.PGconn:
    """A libpq connection that never connected: a revoked handle's, so it reads closed."""
    return pq.PGconn.connect_start(b"pglock_released=1")


class LockSession:
    """One dedicated lock session: its socket, the library's connection, its handles."""

    def __init__(
        self,
        conn: psycopg.Connection[Any],
        dsn: str,
        *,
        backend_pid: int,
        token: str,
        pooled: bool,
    ) -> None:
        self.conn = conn
        # Never prepared: holders' handles name their prepared statements the same
        # way, and DISCARD ALL drops them all.
        conn.prepare_threshold = None
        self.pgconn = conn.pgconn
        #: Serialises every statement on the session, whoever sends it.
        self.guard = threading.RLock()
        conn.lock = self.guard  # type: ignore[assignment]
        self.dsn = dsn
        #: The process that opened the session: no other may use or close it.
        self.pid = os.getpid()
        #: The server's pid of the backend (behind a pooler, not libpq's).
        self.backend_pid = backend_pid
        #: Behind a session-mode pooler: never reused (see connection.verify_session).
        self.pooled = pooled
        #: This session's own value of pglock.session: proof a statement ran on it.
        self.token = token
        self._handles: list[psycopg.Connection[Any]] = []
        #: Whether a holder got a handle since the session was last reset.
        self.handed_out = False

    def __repr__(self) -> str:
        return f"<LockSession backend {self.backend_pid} of process {self.pid}>"

    @property
    def closed(self) -> bool:
        return self.pgconn.status == pq.ConnStatus.BAD

    def handle(self) -> psycopg.Connection[Any]:
        """Return a connection for the holder: pristine client state, dies at revoke."""
        handle = HandleConnection(self.pgconn)
        handle.session = self
        handle.lock = self.guard  # type: ignore[assignment]
        handle.autocommit = True
        self._handles.append(handle)
        self.handed_out = True
        return handle

    def revoke(self, message: str) -> None:
        """Make every handle given out so far fail on its next statement."""
        for handle in list(self._handles):
            self.revoke_one(handle, message)
        # Notices of later holders must not reach a revoked handle's handlers.
        self.pgconn.notice_handler = None
        self.pgconn.notify_handler = None

    def revoke_one(self, handle: psycopg.Connection[Any], message: str) -> None:
        handle.lock = _Revoked(message)  # type: ignore[assignment]
        handle.pgconn = _dead_pgconn()
        with contextlib.suppress(ValueError):
            self._handles.remove(handle)

    def alive(self) -> bool:
        """Whether the server still has the session, read from the socket without a statement.

        Safe in any state between statements (idle, inside the body's
        transaction): it only peeks, so libpq and the body's transaction see
        exactly what they would have seen. A server that ended the session
        sent an error and closed the socket; a cut-off peer fails the client
        keepalives, which errors the socket.
        """
        if self.closed:
            return False
        try:
            sock = socket.socket(fileno=self.pgconn.socket)
        except (psycopg.Error, OSError):
            return False
        try:
            pending = sock.recv(_PEEK_BYTES, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except BlockingIOError:
            return True  # nothing arrived: the usual case
        except OSError:
            return False  # reset, or keepalives found the peer gone
        finally:
            sock.detach()
        if not pending:
            return False  # the server closed the connection
        if self.pgconn.ssl_in_use:
            # Unasked data between statements is the server's goodbye in practice
            # (notifications wait for the end of a transaction); encrypted, it
            # cannot be read without consuming it.
            return self.pgconn.transaction_status == pq.TransactionStatus.IDLE
        return _ERROR_MESSAGE not in _message_types(pending)

    def close(self) -> None:
        """Close the session (its locks go with it); only in the process that opened it."""
        if self.pid == os.getpid():
            self.conn.close()


def _message_types(data: bytes) -> list[bytes]:
    """The type bytes of the protocol messages that start ``data`` (type, int32 length)."""
    types, at = [], 0
    while at + 5 <= len(data):
        types.append(data[at : at + 1])
        at += 1 + int.from_bytes(data[at + 1 : at + 5], "big")
    return types


_guard = threading.Lock()
# Sockets being opened, not registered yet: a fork waits for them (see opening()).
_opening = 0
_fork_barrier = threading.Condition()
#: How long a fork waits for sessions being opened before it goes ahead anyway.
FORK_WAIT = 30.0
_open: set[LockSession] = set()
_idle: dict[str, list[LockSession]] = {}
# A child's copies of its parent's sessions: kept alive, never finalized.
_inherited: list[LockSession] = []


@contextlib.contextmanager
def opening() -> Iterator[None]:
    """Around opening a session until it is registered: a fork meanwhile waits.

    A child forked while a socket exists that is not registered yet would keep
    a copy of it open, and with it the parent's locks after the parent died.
    """
    global _opening
    with _fork_barrier:
        _opening += 1
    try:
        yield
    finally:
        with _fork_barrier:
            _opening -= 1
            if not _opening:
                _fork_barrier.notify_all()


def register(session: LockSession) -> None:
    """Track a lock session opened by this process (inside ``opening()``)."""
    with _guard:
        _open.add(session)


def take(config: PglockConfig) -> LockSession | None:
    """An idle session of this process for ``config``'s DSN, or None."""
    with _guard:
        stack = _idle.get(config.require_dsn())
        return stack.pop() if stack else None


def give_back(config: PglockConfig, session: LockSession) -> bool:
    """Keep ``session`` for a later lock; False (caller discards it) when it may not be."""
    with _guard:
        stack = _idle.setdefault(config.require_dsn(), [])
        if len(stack) >= config.idle_sessions or session.pid != os.getpid() or session.pooled:
            return False
        session.handed_out = False
        stack.append(session)
        return True


def discard(session: LockSession) -> None:
    """Close a session that is not going back, and forget it.

    Closed first: a child forked in between must find its socket gone, not miss it.
    """
    session.close()
    with _guard:
        _open.discard(session)


def idle_count() -> int:
    """Idle sessions this process keeps (for tests and benchmarks)."""
    with _guard:
        return sum(len(stack) for stack in _idle.values())


def close_idle() -> None:
    """Close every idle session of this process."""
    with _guard:
        stacks = list(_idle.values())
        _idle.clear()
    for stack in stacks:
        for session in stack:
            discard(session)


def _before_fork() -> None:
    _fork_barrier.acquire()
    _fork_barrier.wait_for(lambda: _opening == 0, timeout=FORK_WAIT)


def _after_fork_in_parent() -> None:
    _fork_barrier.release()


def _after_fork_in_child() -> None:
    global _guard, _fork_barrier, _opening
    # The parent's threads are gone; a lock one of them held would never be released.
    _guard = threading.Lock()
    _fork_barrier, _opening = threading.Condition(), 0
    for session in list(_open):
        if not session.closed:
            with contextlib.suppress(OSError, psycopg.Error):
                os.close(session.pgconn.socket)
        # Nothing of the child's may write to that descriptor number again.
        session.revoke("this lock connection belongs to the parent process")
        session.conn.pgconn = _dead_pgconn()
        _inherited.append(session)
    _open.clear()
    _idle.clear()


os.register_at_fork(
    before=_before_fork,
    after_in_parent=_after_fork_in_parent,
    after_in_child=_after_fork_in_child,
)
