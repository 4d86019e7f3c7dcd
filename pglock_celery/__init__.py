"""Postgres advisory locks as the single mutual-exclusion authority for Celery tasks."""

from __future__ import annotations

from .exceptions import (
    ConfigurationError,
    LockLost,
    LockNameError,
    LockTimeout,
    LockUnavailable,
    PglockError,
)
from .guard import install_guard, remove_guard
from .inspect import holder
from .keys import lock_key
from .lock import AdvisoryLock, current_lock, shard_of, try_lock, wait_lock
from .task import (
    LOCK_LOST_EVENT,
    LOCK_SKIPPED_EVENT,
    SkipHolder,
    SkipResult,
    TenantLockedTask,
    skipped,
)

__version__ = "0.2.0"

__all__ = [
    "LOCK_LOST_EVENT",
    "LOCK_SKIPPED_EVENT",
    "AdvisoryLock",
    "ConfigurationError",
    "LockLost",
    "LockNameError",
    "LockTimeout",
    "LockUnavailable",
    "PglockError",
    "SkipHolder",
    "SkipResult",
    "TenantLockedTask",
    "current_lock",
    "holder",
    "install_guard",
    "lock_key",
    "remove_guard",
    "shard_of",
    "skipped",
    "try_lock",
    "wait_lock",
]
