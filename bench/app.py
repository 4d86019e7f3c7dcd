"""The Celery app the throughput benchmark runs in real workers."""

from __future__ import annotations

import os
import threading
import time
import uuid
from typing import Any

import redis
from celery import Celery, Task

from pglock_celery import TenantLockedTask

BROKER = os.environ.get("PGLOCK_BENCH_BROKER", "redis://127.0.0.1:6379/0")

app = Celery("pglock_bench", broker=BROKER, backend=BROKER)
app.conf.update(
    task_default_queue=os.environ.get("PGLOCK_BENCH_QUEUE", "pglock-bench"),
    worker_prefetch_multiplier=4,
    result_expires=600,
    broker_connection_retry_on_startup=True,
)

_UNLOCK = """
if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end
return 0
"""


class RedisLeaseTask(Task):  # type: ignore[type-arg]
    """What celery-once and celery-singleton do: SET NX PX, then a token-checked delete."""

    ttl_ms = 30_000
    _client: redis.Redis | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._client is None:
            type(self)._client = redis.Redis.from_url(BROKER)
        client = self._client
        assert client is not None
        key, token = f"lease:tenant:{args[0]}", uuid.uuid4().hex
        if not client.set(key, token, nx=True, px=self.ttl_ms):
            return {"skipped": True}
        try:
            return super().__call__(*args, **kwargs)
        finally:
            client.eval(_UNLOCK, 1, key, token)


@app.task
def plain(tenant_id: int) -> None:
    return None


@app.task(base=TenantLockedTask)
def locked(tenant_id: int) -> None:
    return None


@app.task(base=RedisLeaseTask)
def leased(tenant_id: int) -> None:
    return None


@app.task(base=TenantLockedTask)
def hold(tenant_id: int, seconds: float) -> None:
    import time

    time.sleep(seconds)


# The scale section's holders: each takes its lock, counts itself in Redis, and keeps
# the lock until the benchmark lets every holder go at once by creating a flag file.
# One watcher per process looks for the file, so 1,000 greenlets do not poll it.
_released = threading.Event()
_watcher = threading.Lock()
_watching: list[str] = []
_counter: list[redis.Redis] = []


def _watch(flag: str) -> None:
    while not os.path.exists(flag):
        time.sleep(0.05)
    _released.set()


@app.task(base=TenantLockedTask, lock_name="bench-hold:{tenant_id}", ignore_result=True)
def hold_until(tenant_id: int, flag: str, counter: str, limit: float = 180.0) -> None:
    """Hold the lock until ``flag`` exists; count the holders in Redis key ``counter``."""
    with _watcher:
        if not _watching:
            _watching.append(flag)
            _counter.append(redis.Redis.from_url(BROKER))
            threading.Thread(target=_watch, args=(flag,), daemon=True).start()
    _counter[0].incr(counter)
    _released.wait(limit)
