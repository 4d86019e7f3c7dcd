"""Helpers of the adversarial tests: real Postgres sessions, nothing mocked."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import psycopg

from pglock_celery.config import PglockConfig
from pglock_celery.lock import AdvisoryLock


def make_lock(dsn: str, name: str | int, **config: Any) -> AdvisoryLock:
    """A try-lock with its own config (strategy reuse unless told)."""
    wait = config.pop("wait", False)
    timeout = config.pop("timeout", None)
    return AdvisoryLock(name, config=PglockConfig(dsn=dsn, **config), wait=wait, timeout=timeout)


def taken_elsewhere(dsn: str, key: int) -> bool:
    """Whether a brand-new plain session can take ``key`` now (it lets go at once)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT pg_try_advisory_lock(%s::int8)", (key,)).fetchone()
        got = bool(row and row[0])
        if got:
            conn.execute("SELECT pg_advisory_unlock(%s::int8)", (key,))
        return got


def terminate(dsn: str, backend_pid: int) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SELECT pg_terminate_backend(%s)", (backend_pid,))


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
