"""Fault injection on servers the chaos tests own: their own Postgres and Redis.

Restarting, terminating and partitioning only ever touch these throwaway
servers and the processes the tests started.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

from tests.support.history import create_history, drop_history
from tests.support.leftovers import leftovers
from tests.support.services import EmbeddedPostgres, EmbeddedRedis, wait_until
from tests.support.workers import Worker

#: Chaos workers check their lock sessions often, to keep the tests short.
CHECK_INTERVAL = 0.5


@pytest.fixture(scope="session")
def chaos_pg(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedPostgres]:
    server = EmbeddedPostgres(tmp_path_factory.mktemp("chaos-pg"))
    server.init()
    server.start()
    yield server
    wait_until(lambda: leftovers(server.dsn) == (0, 0), 15, "chaos lock sessions to go")
    server.destroy()


@pytest.fixture(scope="session")
def chaos_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedRedis]:
    server = EmbeddedRedis(tmp_path_factory.mktemp("chaos-redis"))
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def chaos_app(chaos_redis: EmbeddedRedis) -> Celery:
    """A client app of its own: sends tests.apps.core tasks by name."""
    return Celery("pglock-chaos", broker=chaos_redis.url, backend=chaos_redis.url)


class Chaos:
    """Start workers on the chaos servers and send them tasks."""

    def __init__(self, pg: EmbeddedPostgres, redis: EmbeddedRedis, app: Celery, logs: Path):
        self.pg = pg
        self.redis = redis
        self.app = app
        self.logs = logs
        self.workers: list[Worker] = []
        self.queue = f"chaos-{uuid.uuid4().hex[:8]}"

    @property
    def dsn(self) -> str:
        return self.pg.dsn

    def env(self, **extra: str) -> dict[str, str]:
        return {
            "PGLOCK_DSN": self.pg.dsn,
            "PGLOCK_TEST_BROKER": self.redis.url,
            "PGLOCK_TEST_QUEUE": self.queue,
            "PGLOCK_CHECK_INTERVAL": str(CHECK_INTERVAL),
            **extra,
        }

    def worker(self, concurrency: int = 2, **extra: str) -> Worker:
        env = self.env(**extra)
        worker = Worker(self.app, "tests.apps.core", env, self.logs, concurrency=concurrency)
        self.workers.append(worker)
        return worker

    def send(self, task: str, *args: Any, queue: str | None = None) -> Any:
        return self.app.send_task(f"tests.apps.core.{task}", args, queue=queue or self.queue)

    def logs_text(self) -> str:
        return "\n".join(w.log.read_text(errors="replace") for w in self.workers)

    def stop(self) -> None:
        for worker in self.workers:
            worker.stop()


@pytest.fixture
def chaos(
    chaos_pg: EmbeddedPostgres, chaos_redis: EmbeddedRedis, chaos_app: Celery, log_dir: Path
) -> Iterator[Chaos]:
    world = Chaos(chaos_pg, chaos_redis, chaos_app, log_dir)
    yield world
    world.stop()


@pytest.fixture
def history(chaos_pg: EmbeddedPostgres) -> Iterator[str]:
    table = create_history(chaos_pg.dsn)
    yield table
    drop_history(chaos_pg.dsn, table)
