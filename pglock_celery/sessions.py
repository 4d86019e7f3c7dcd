"""Where lock sessions come from: a new one per lock, or this process's idle ones.

Strategy ``connect`` opens a session for each lock and closes it on release.
Strategy ``reuse`` keeps a few idle lock-only sessions per process and DSN: a
session is checked out by one holder at a time, and goes back only after its
unlock returned true and nothing else went wrong; any doubt closes it.

A forked child must neither use nor close its parent's sessions: after a fork
the child closes its copies of their sockets (so only the parent's own life
decides when they end) and keeps the objects unfinalized, so that libpq never
writes a goodbye on a socket the parent still uses.
"""

from __future__ import annotations

import contextlib
import os
import threading
import weakref

import psycopg

from .config import PglockConfig

CONNECT, REUSE = "connect", "reuse"

_guard = threading.Lock()
_pid = os.getpid()
_open: weakref.WeakSet[psycopg.Connection] = weakref.WeakSet()
_idle: dict[str, list[psycopg.Connection]] = {}
# A child's copies of its parent's sessions: kept alive, never finalized.
_inherited: list[psycopg.Connection] = []


def register(conn: psycopg.Connection) -> None:
    """Track a lock session opened by this process."""
    with _guard:
        _open.add(conn)


def take(config: PglockConfig) -> psycopg.Connection | None:
    """An idle session of this process for ``config``'s DSN, or None."""
    with _guard:
        stack = _idle.get(config.require_dsn())
        return stack.pop() if stack else None


def give_back(config: PglockConfig, conn: psycopg.Connection) -> bool:
    """Keep ``conn`` for a later lock; False (caller closes it) when enough are kept."""
    with _guard:
        stack = _idle.setdefault(config.require_dsn(), [])
        if len(stack) >= config.idle_sessions or os.getpid() != _pid:
            return False
        stack.append(conn)
        return True


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
        for conn in stack:
            conn.close()


def _after_fork_in_child() -> None:
    global _pid
    _pid = os.getpid()
    _idle.clear()
    for conn in list(_open):
        with contextlib.suppress(OSError, psycopg.Error):
            os.close(conn.pgconn.socket)
        _inherited.append(conn)
    _open.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)
