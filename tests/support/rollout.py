"""A change of the shards as the tests drive it: the operator's steps as `pglock-celery
shards` builds them, the three maps' configurations, and a name that moves."""

from __future__ import annotations

import argparse
import contextlib
import json
import uuid
from typing import Any

import pytest

from pglock_celery import LockUnavailable, cli
from pglock_celery.config import PglockConfig
from pglock_celery.keys import lock_key
from pglock_celery.lock import AdvisoryLock
from pglock_celery.rollout import Rollout
from pglock_celery.shards import parse_shards


def operator(
    env: pytest.MonkeyPatch, new: dict[str, str], old: dict[str, str] | None = None
) -> Rollout:
    """The Rollout `pglock-celery shards ...` runs with this configuration."""
    env.setenv("PGLOCK_SHARDS", json.dumps(new))
    if old is None:
        env.delenv("PGLOCK_SHARDS_PREVIOUS", raising=False)
    else:
        env.setenv("PGLOCK_SHARDS_PREVIOUS", json.dumps(old))
    return cli._rollout(argparse.Namespace(app=None, dsn=None))


def configs(
    old: dict[str, str], new: dict[str, str], **settings: Any
) -> tuple[PglockConfig, PglockConfig, PglockConfig]:
    """Old-map, transition and new-map configurations (apart by their prefixes)."""
    return (
        PglockConfig(shards=parse_shards(old), application_name="pglock-old", **settings),
        PglockConfig(
            shards=parse_shards(new),
            shards_previous=parse_shards(old),
            application_name="pglock-tr",
            **settings,
        ),
        PglockConfig(shards=parse_shards(new), application_name="pglock-new", **settings),
    )


def moving(old: dict[str, str], new: dict[str, str]) -> tuple[str, str, str]:
    """A name whose database differs between the maps, its old DSN and its new DSN."""
    o, n = PglockConfig(shards=parse_shards(old)), PglockConfig(shards=parse_shards(new))
    for i in range(1000):
        name = f"tenant:{uuid.uuid4().hex[:6]}-{i}"
        key = lock_key(name)
        before, now = o.for_key(key, name).dsn, n.for_key(key, name).dsn
        if before != now:
            assert before is not None and now is not None
            return name, before, now
    raise AssertionError("no moving name")


def moving_name(old: dict[str, str], new: dict[str, str]) -> str:
    """A name whose database differs between the maps."""
    return moving(old, new)[0]


def try_hold(lock: AdvisoryLock) -> bool:
    """Acquire ``lock`` (a refusal counts as not held); the caller releases it."""
    try:
        return lock.acquire()
    except LockUnavailable:
        return False


def let_go(*locks: AdvisoryLock) -> None:
    """Release each of ``locks`` in turn, whatever state it is in (a test's clean-up)."""
    for lock in locks:
        with contextlib.suppress(Exception):
            lock.release()
