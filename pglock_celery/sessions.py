"""Where lock sessions come from: a new one per lock, or this process's idle ones.

Strategy ``connect`` opens a session for each lock and closes it on release.
Strategy ``reuse`` keeps a few idle sessions per process and DSN: a session is
checked out by one holder at a time and goes back only after a clean unlock;
a session a holder had a handle to is reset with ``DISCARD ALL`` first (its
server-side state back to the session's start); any doubt closes it.
Strategy ``shared`` lets every lock of a process share at most
``pglock_shared_sessions`` sessions per DSN. Session locks are re-entrant, so
an in-process registry of claimed names keeps two holders of this process off
one name: the second finds it claimed, as if another worker held it.

A forked child must neither use nor close its parent's sessions: after a fork
the child closes its copies of every session's socket (so only the parent's
own life decides when they end) and keeps the objects unfinalized, so that
libpq never writes a goodbye on a descriptor number that may be reused.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterator

import psycopg

from .config import PglockConfig
from .handles import dead_pgconn
from .lock_session import LockSession

CONNECT, REUSE, SHARED = "connect", "reuse", "shared"


_guard = threading.Lock()
# Sockets being opened, not registered yet: a fork waits for them (see opening()).
_opening = 0
_fork_barrier = threading.Condition()
#: How long a fork waits for sessions being opened before it goes ahead anyway.
FORK_WAIT = 30.0
_open: set[LockSession] = set()
# The shared strategy: sessions per DSN, slots being opened, names claimed here.
_shared: dict[str, list[LockSession]] = {}
_shared_opening: dict[str, int] = {}
_shared_ready = threading.Condition(_guard)
_claimed: set[tuple[str, int]] = set()
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


#: How long an unlock sent without waiting (see protocol.py) stays unread in the
#: cache before the monitor scheduler reads it, when no next lock did.
CONFIRM_AFTER = 0.05


def confirm_idle() -> bool:
    """Read what idle sessions' unlocks returned; whether some are left to read.

    A session busy meanwhile (taken by a holder, which reads it first) is left
    alone; one whose unlock went wrong is closed.
    """
    now = time.monotonic()
    with _guard:
        pending = [s for stack in _idle.values() for s in stack if s.pending]
    left = False
    for session in pending:
        if now - session.pending_since < CONFIRM_AFTER:
            left = True
        elif session.guard.acquire(blocking=False):
            try:
                _settle(session)
            finally:
                session.guard.release()
    return left


def settle_pending() -> bool:
    """Wait for every unlock this process's sessions sent without waiting; whether any were.

    Idle or taken by another holder (which reads it first), whatever their DSN:
    a lock this process released a moment ago is free once they are read.
    """
    with _guard:
        pending = [s for s in _open if s.pending and s.pid == os.getpid()]
    for session in pending:
        with session.guard:
            if session.pending:
                _settle(session)
    return bool(pending)


# At exit, what the last unlocks show is reported before the process goes.
atexit.register(settle_pending)


def _settle(session: LockSession) -> None:
    try:
        session.settle()
    except psycopg.Error:
        with _guard:
            stack = _idle.get(session.dsn, [])
            if session in stack:
                stack.remove(session)
        discard(session)


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


def locked() -> threading.Lock:
    """The registry's lock (anew after a fork), for state kept on sessions."""
    return _guard


def claim(dsn: str, key: int) -> bool:
    """Claim ``key`` for one holder of this process; False when another has it."""
    with _guard:
        if (dsn, key) in _claimed:
            return False
        _claimed.add((dsn, key))
        return True


def unclaim(dsn: str, key: int) -> None:
    with _guard:
        _claimed.discard((dsn, key))


def shared_session(config: PglockConfig, open_one: Callable[[], LockSession]) -> LockSession:
    """The least busy shared session for ``config``'s DSN, opening one while below the bound.

    At most ``config.shared_sessions`` are open or being opened per DSN; a
    caller that finds none ready waits for one being opened by another.
    """
    dsn = config.require_dsn()
    with _shared_ready:
        while True:
            pool = _shared.setdefault(dsn, [])
            pool[:] = [session for session in pool if not session.closed]
            opening = _shared_opening.get(dsn, 0)
            idle = [session for session in pool if not session.holds]
            if pool and (idle or len(pool) + opening >= config.shared_sessions):
                return min(idle or pool, key=lambda session: len(session.holds))
            if len(pool) + opening < config.shared_sessions:
                _shared_opening[dsn] = opening + 1
                break
            _shared_ready.wait()
    try:
        session = open_one()
        session.shared = True
    finally:
        with _shared_ready:
            _shared_opening[dsn] -= 1
            _shared_ready.notify_all()
    with _shared_ready:
        _shared[dsn].append(session)
    return session


def drop_shared(session: LockSession) -> None:
    """Take a failed shared session out of its pool and close it."""
    with _guard:
        pool = _shared.get(session.dsn, [])
        if session in pool:
            pool.remove(session)
    discard(session)


def shared_count(dsn: str) -> int:
    """Shared sessions this process has open for ``dsn`` (for tests and benchmarks)."""
    with _guard:
        return len(_shared.get(dsn, []))


def close_shared() -> None:
    """Close every shared session of this process that holds nothing."""
    with _guard:
        quiet = [s for pool in _shared.values() for s in pool if not s.holds]
        for pool in _shared.values():
            pool[:] = [s for s in pool if s.holds]
    for session in quiet:
        discard(session)


def _before_fork() -> None:
    _fork_barrier.acquire()
    _fork_barrier.wait_for(lambda: _opening == 0, timeout=FORK_WAIT)


def _after_fork_in_parent() -> None:
    _fork_barrier.release()


def _after_fork_in_child() -> None:
    global _guard, _fork_barrier, _opening, _shared_ready
    # The parent's threads are gone; a lock one of them held would never be released.
    _guard = threading.Lock()
    _shared_ready = threading.Condition(_guard)
    _fork_barrier, _opening = threading.Condition(), 0
    _shared.clear()
    _shared_opening.clear()
    _claimed.clear()
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
