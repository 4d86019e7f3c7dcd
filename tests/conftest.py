"""Service fixtures shared by every test suite: Postgres and Redis, found or started."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers.services import postgres_for_tests, redis_for_tests

#: In CI a capability the machine lacks must fail the run, never skip.
IN_CI = os.environ.get("CI", "").lower() == "true"


@pytest.fixture(scope="session")
def pg_dsn(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with postgres_for_tests(tmp_path_factory.mktemp("postgres")) as dsn:
        yield dsn


@pytest.fixture(scope="session")
def broker_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with redis_for_tests(tmp_path_factory.mktemp("redis")) as url:
        yield url


@pytest.fixture
def run_id() -> str:
    """A short id that keeps one test's tenants apart from every other's."""
    return uuid.uuid4().hex[:8]


@pytest.fixture(scope="session")
def log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("logs")
