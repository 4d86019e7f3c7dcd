"""Looking at locks from elsewhere: another session of the server, as another worker would."""

from __future__ import annotations

from typing import Any

import psycopg

from pglock_celery import lock_key
from pglock_celery.config import PglockConfig
from pglock_celery.lock import AdvisoryLock

STRATEGIES = ("reuse", "connect", "shared")


def key_of(name_or_key: str | int) -> int:
    return lock_key(name_or_key) if isinstance(name_or_key, str) else name_or_key


def free_elsewhere(dsn: str, name_or_key: str | int) -> bool:
    """Whether another session can take the lock now, on its first try (it lets it go)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT pg_try_advisory_lock(%s)", (key_of(name_or_key),)).fetchone()
        conn.execute("SELECT pg_advisory_unlock_all()")
    return bool(row and row[0])


def lock(dsn: str, name: str, **settings: Any) -> AdvisoryLock:
    """An AdvisoryLock with its own settings (strategy, check_interval, ...) on ``dsn``."""
    wait = settings.pop("wait", False)
    timeout = settings.pop("timeout", None)
    config = PglockConfig(dsn=dsn, **settings)
    return AdvisoryLock(name, config=config, wait=wait, timeout=timeout)
