"""The public names of DESIGN.md, exactly."""

from __future__ import annotations

import pglock_celery
from pglock_celery import (
    ConfigurationError,
    LockLost,
    LockNameError,
    LockTimeout,
    LockUnavailable,
    PglockError,
)

CONTRACT = {
    "TenantLockedTask",
    "lock_key",
    "try_lock",
    "wait_lock",
    "current_lock",
    "PglockError",
    "LockUnavailable",
    "LockTimeout",
    "LockLost",
    "holder",
    "shard_of",
}


def test_contract_names_are_exported() -> None:
    assert set(pglock_celery.__all__) >= CONTRACT
    assert len(set(pglock_celery.__all__)) == len(pglock_celery.__all__)
    for name in pglock_celery.__all__:
        assert hasattr(pglock_celery, name)


def test_errors_share_one_base_and_live_in_the_package() -> None:
    for cls in (ConfigurationError, LockNameError, LockUnavailable, LockTimeout, LockLost):
        assert issubclass(cls, PglockError)
        assert cls.__module__ == "pglock_celery"


def test_error_without_a_message_uses_its_docstring() -> None:
    assert str(LockLost()) == "The lock is no longer held by this session."


def test_current_lock_is_none_outside_a_task() -> None:
    assert pglock_celery.current_lock() is None


def test_shard_of_names_the_default_shard_without_shards() -> None:
    assert pglock_celery.shard_of("tenant:1") == "default"
    assert pglock_celery.shard_of(pglock_celery.lock_key("tenant:1")) == "default"
