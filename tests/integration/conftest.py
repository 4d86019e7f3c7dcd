"""Real workers on real services for the integration tests."""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from celery import Celery
from psycopg import sql as psql
from psycopg.conninfo import make_conninfo

from pglock_celery.sources import registry
from tests.apps.core import app as core_app
from tests.support.history import create_history, drop_history
from tests.support.leftovers import leftovers
from tests.support.services import EmbeddedPostgres, scalar, wait_until
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
def empty_cache() -> Iterator[None]:
    """No idle or shared lock session of this process before the test and after it."""
    registry.close()
    yield
    registry.close()


@pytest.fixture
def server_of_its_own(tmp_path: Path) -> Iterator[Callable[..., str]]:
    """Start a throwaway Postgres with extra ``postgresql.conf`` lines; return its DSN.

    For what no shared server may be put through (a filled lock table, a crash
    restart). This process's idle sessions go, then the server, after the test.
    """
    started: list[EmbeddedPostgres] = []

    def start(*settings: str) -> str:
        server = EmbeddedPostgres(tmp_path / f"pg{len(started)}")
        started.append(server)
        server.init(*settings)
        server.start()
        return server.dsn

    try:
        yield start
    finally:
        registry.close()
        for server in started:
            server.destroy()


@pytest.fixture
def table(pg_dsn: str, run_id: str) -> Iterator[str]:
    """A table of the test's own, ``(v int)``, dropped after it."""
    name = f"t_{run_id}"
    scalar(pg_dsn, f"CREATE TABLE {name} (v int)")
    yield name
    scalar(pg_dsn, f"DROP TABLE {name}")


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


@pytest.fixture
def make_dbs(pg_dsn: str) -> Iterator[Callable[[int], list[str]]]:
    """Create databases pglock_rollout_<random>; each DSN given back; all dropped after."""
    made: list[str] = []

    def make(count: int) -> list[str]:
        dsns = []
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            for _ in range(count):
                name = f"pglock_rollout_{uuid.uuid4().hex[:10]}"
                conn.execute(psql.SQL("CREATE DATABASE {}").format(psql.Identifier(name)))
                made.append(name)
                dsns.append(make_conninfo(pg_dsn, dbname=name))
        return dsns

    try:
        yield make
    finally:
        registry.close()
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            for name in made:
                conn.execute(
                    psql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
                        psql.Identifier(name)
                    )
                )


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """No PGLOCK_* variable of the run's own: each test sets what it means."""
    for key in list(os.environ):
        if key.startswith("PGLOCK_"):
            monkeypatch.delenv(key)
    return monkeypatch
