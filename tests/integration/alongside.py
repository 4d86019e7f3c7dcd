"""Run twice at once by test_concurrent_runs.py, as two checkouts' `make test` would be.

Not collected by the suite (no test_ prefix): each run holds a lock of one fixed
name and writes one fixed Redis key, both at the same time as the other run.
"""

from __future__ import annotations

import os
from pathlib import Path

import redis

from pglock_celery import try_lock
from tests.support.services import wait_until


def test_a_fixed_lock_name_and_redis_key_are_this_runs_alone(pg_dsn: str, broker_url: str) -> None:
    barrier, me = Path(os.environ["PGLOCK_ALONGSIDE_DIR"]), os.environ["PGLOCK_ALONGSIDE_NAME"]
    other = next(name for name in ("a", "b") if name != me)
    client = redis.Redis.from_url(broker_url)
    with try_lock("alongside:fixed", dsn=pg_dsn) as lock:
        assert lock.acquired, "the other run holds this run's lock"
        client.set("alongside:owner", me)
        (barrier / me).touch()
        wait_until(lambda: (barrier / other).exists(), 60, "the other run to hold it too")
        assert client.get("alongside:owner") == me.encode(), "the other run wrote this run's key"
        (barrier / f"{me}-done").touch()
        wait_until(lambda: (barrier / f"{other}-done").exists(), 60, "the other run to check")
    client.close()
