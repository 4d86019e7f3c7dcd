"""Locks for the tests, and looking at them from elsewhere, as another worker would.

``free_elsewhere`` is the one way the tests ask "could another session take this lock
now?"; ``terminate`` is the one way they end a lock session's backend, as a DBA would.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import Any

import psycopg
from celery import Celery

from pglock_celery import LockLost, lock_key
from pglock_celery.config import PglockConfig
from pglock_celery.lock import AdvisoryLock

#: Every value of pglock_strategy.
STRATEGIES = ("reuse", "connect", "shared")
#: The strategies that give a holder a session of its own (lock.connection, transaction()).
DEDICATED = ("reuse", "connect")


def eager_app(dsn: str, name: str = "eager", **settings: Any) -> Celery:
    """An app whose tasks run in the caller (``apply``), with locks on ``dsn``.

    Each keyword is a pglock setting without its prefix (``check_interval=0.2``).
    """
    app = Celery(name, set_as_current=False, broker="memory://", backend="cache+memory://")
    app.conf.update(pglock_dsn=dsn, task_store_eager_result=True)
    app.conf.update({f"pglock_{key}": value for key, value in settings.items()})
    return app


def key_of(name_or_key: str | int) -> int:
    return lock_key(name_or_key) if isinstance(name_or_key, str) else name_or_key


def lock(dsn: str, name: str | int, **settings: Any) -> AdvisoryLock:
    """An AdvisoryLock with settings of its own (strategy, check_interval, ...) on ``dsn``.

    ``wait`` and ``timeout`` are the lock's own; every other keyword is a PglockConfig
    field (strategy reuse unless given).
    """
    wait = settings.pop("wait", False)
    timeout = settings.pop("timeout", None)
    return AdvisoryLock(name, config=PglockConfig(dsn=dsn, **settings), wait=wait, timeout=timeout)


def free_elsewhere(where: str | psycopg.Connection[Any], name_or_key: str | int) -> bool:
    """Whether another session can take the lock now, on its first try (it lets it go).

    ``where`` is a DSN (a new session each time) or an autocommit connection of the
    test's own that holds no lock of its own on that key (kept for a tight loop).
    """
    if isinstance(where, str):
        with psycopg.connect(where, autocommit=True) as conn:
            return free_elsewhere(conn, name_or_key)
    key = key_of(name_or_key)
    row = where.execute("SELECT pg_try_advisory_lock(%s::int8)", (key,)).fetchone()
    taken = bool(row and row[0])
    if taken:
        where.execute("SELECT pg_advisory_unlock(%s::int8)", (key,))
    return taken


def held_elsewhere(dsn: str, name_or_key: str | int) -> psycopg.Connection[Any]:
    """A plain session holding the lock, as another worker would; closing it frees the lock."""
    conn = psycopg.connect(dsn, autocommit=True)
    conn.execute("SELECT pg_advisory_lock(%s::int8)", (key_of(name_or_key),))
    return conn


def finish(held: AdvisoryLock) -> None:
    """Release ``held`` and let a loss found at release pass (the test looks elsewhere)."""
    with contextlib.suppress(LockLost):
        held.release()


def terminate(dsn: str, backend_pid: int) -> bool:
    """End ``backend_pid``'s session from another one; whether a backend was signalled."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT pg_terminate_backend(%s)", (backend_pid,)).fetchone()
    return bool(row and row[0])


def run_bounded(fn: Callable[[], Any], seconds: float) -> tuple[bool, Any]:
    """Run ``fn`` in a daemon thread; return (finished in time, result or exception)."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["result"] = fn()
        except BaseException as exc:
            box["result"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    return (not thread.is_alive()), box.get("result")
