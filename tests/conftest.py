"""Service fixtures shared by every test suite: Postgres and Redis, found or started.

The run works in a Postgres database and a Redis database of its own on whatever
servers it found (see tests/support/services.py), so two runs on one machine, a
`make run` or a bench never see each other's locks, sessions, queues or keys.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import netns
from tests.support.ci import missing
from tests.support.services import (
    own_database,
    own_redis_database,
    postgres_for_tests,
    redis_for_tests,
)


@pytest.fixture(scope="session")
def pg_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A DSN of the server the run uses (its own database is ``pg_dsn``)."""
    with postgres_for_tests(tmp_path_factory.mktemp("postgres")) as dsn:
        yield dsn


@pytest.fixture(scope="session")
def pg_dsn(pg_server: str) -> Iterator[str]:
    """A database of this run's own, dropped at the end."""
    with own_database(pg_server) as dsn:
        yield dsn


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A URL of the Redis server the run uses (its own database is ``broker_url``)."""
    with redis_for_tests(tmp_path_factory.mktemp("redis")) as url:
        yield url


@pytest.fixture(scope="session")
def broker_url(redis_server: str) -> Iterator[str]:
    """A Redis database of this run's own (never 0, `make run`'s), cleared at the end."""
    with own_redis_database(redis_server) as own:
        yield own


@pytest.fixture
def run_id() -> str:
    """A short id that keeps one test's tenants apart from every other's."""
    return uuid.uuid4().hex[:8]


@pytest.fixture(scope="session")
def log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("logs")


@pytest.fixture
def guest() -> Iterator[netns.Guest]:
    """A network namespace of the test's own; a missing capability fails in CI."""
    why = netns.available()
    if why is not None:
        missing(f"a network namespace cannot be made here: {why}")
    host = netns.Guest()
    host.destroy()  # a leftover of a crashed run of ours, by the same name
    host.create()
    yield host
    host.destroy()
