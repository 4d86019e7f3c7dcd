"""Tasks whose body computes without yielding (real workers).

Loaded by a worker as ``-A tests.apps.computing``: the task joins the core app. Its
body is a tight pure-Python loop: under gevent and eventlet it never lets the hub
run, under the threads pool it never waits in C. When the body stops, it writes the
wall-clock time to the test's Redis key, so the test can tell when it was stopped.
"""

from __future__ import annotations

import time
from typing import Any

from pglock_celery import LockLost, TenantLockedTask
from tests.apps.core import _marker, app

__all__ = ["app", "compute_under_lock"]


@app.task(base=TenantLockedTask)
def compute_under_lock(tenant_id: str, seconds: float, stopped_key: str) -> dict[str, Any]:
    """Count for ``seconds`` under the lock without ever yielding; record when it stopped."""
    started = time.monotonic()
    count = 0
    try:
        while time.monotonic() - started < seconds:
            count += 1
    finally:
        stopped = repr(time.time())
        for _ in range(3):  # a LockLost that comes in the write (its first yield) ends no record
            try:
                _marker().set(stopped_key, stopped, ex=600)
                break
            except LockLost:
                continue
    return {"computed": time.monotonic() - started, "count": count}
