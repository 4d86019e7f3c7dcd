"""Real workers on real services for the integration tests."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from celery import Celery

from pglock_celery.sources import registry
from tests.apps.core import app as core_app
from tests.support.history import create_history, drop_history
from tests.support.leftovers import leftovers
from tests.support.services import wait_until
from tests.support.workers import Worker


@pytest.fixture(scope="session", autouse=True)
def nothing_leaks_after_the_suite(pg_dsn: str) -> Iterator[None]:
    """After every test and worker is done: no lock session, no advisory lock."""
    yield
    registry.close()  # this process's cached sessions hold nothing; close them too
    wait_until(lambda: leftovers(pg_dsn) == (0, 0), 10, "lock sessions and locks to go")


@pytest.fixture(scope="session")
def queue() -> str:
    return f"pglock-tests-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="session")
def worker_env(pg_dsn: str, broker_url: str, queue: str) -> dict[str, str]:
    return {"PGLOCK_DSN": pg_dsn, "PGLOCK_TEST_BROKER": broker_url, "PGLOCK_TEST_QUEUE": queue}


@pytest.fixture(scope="session")
def app(broker_url: str, queue: str, pg_dsn: str) -> Celery:
    core_app.conf.update(
        broker_url=broker_url,
        result_backend=broker_url,
        task_default_queue=queue,
        pglock_dsn=pg_dsn,
    )
    return core_app


@pytest.fixture(scope="session")
def workers(app: Celery, worker_env: dict[str, str], log_dir: Path) -> Iterator[list[Worker]]:
    """Two prefork workers, two processes each, on the session's queue."""
    started: list[Worker] = []
    try:
        for _ in range(2):
            started.append(Worker(app, "tests.apps.core", worker_env, log_dir, concurrency=2))
        yield started
    finally:
        for worker in started:
            worker.stop()


@pytest.fixture
def admin(pg_dsn: str) -> Iterator[psycopg.Connection[Any]]:
    """A plain autocommit connection to the run's database, to look from outside."""
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        yield conn


@pytest.fixture
def history(pg_dsn: str) -> Iterator[str]:
    table = create_history(pg_dsn)
    yield table
    drop_history(pg_dsn, table)
