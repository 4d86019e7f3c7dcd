"""Where lock sessions come from: a new one per lock, or this process's idle ones.

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
import os
import threading
from collections.abc import Iterator

import psycopg

from .config import PglockConfig
from .lock_session import LockSession, dead_pgconn

CONNECT, REUSE = "connect", "reuse"


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
        session.conn.pgconn = dead_pgconn()
        _inherited.append(session)
    _open.clear()
    _idle.clear()


os.register_at_fork(
    before=_before_fork,
    after_in_parent=_after_fork_in_parent,
    after_in_child=_after_fork_in_child,
)
