"""Real `celery worker` processes on a map of shards (pglock_shards over databases)."""

from __future__ import annotations

import json
from pathlib import Path

from celery import Celery

from .history import create_history
from .workers import Worker


def start_shard_workers(
    app: Celery,
    worker_env: dict[str, str],
    log_dir: Path,
    queue: str,
    shards: dict[str, str],
    *,
    previous: dict[str, str] | None = None,
    count: int = 1,
) -> list[Worker]:
    """``count`` prefork workers of tests.apps.core on ``shards`` (and, during a change
    of the shards, ``previous``), listening on ``queue`` alone: a queue of their own
    keeps the session's unsharded workers, if running, from taking their calls."""
    env = {
        **worker_env,
        "PGLOCK_DSN": "",
        "PGLOCK_SHARDS": json.dumps(shards),
        "PGLOCK_SHARDS_PREVIOUS": json.dumps(previous) if previous else "",
        "PGLOCK_TEST_QUEUE": queue,
    }
    started: list[Worker] = []
    try:
        for _ in range(count):
            started.append(Worker(app, "tests.apps.core", env, log_dir, concurrency=2))
    except BaseException:
        stop_all(started)
        raise
    return started


def stop_all(workers: list[Worker]) -> None:
    for worker in workers:
        worker.stop()


def history_everywhere(shards: dict[str, str]) -> str:
    """One history table, of one name, in every shard's database; its name."""
    first, *others = shards.values()
    name = create_history(first)
    for dsn in others:
        create_history(dsn, name)
    return name
