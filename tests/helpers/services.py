"""The tests' services: PGLOCK_TEST_DSN / PGLOCK_TEST_BROKER, else local, else embedded."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from tasks.services import (
    LOCAL_BROKER,
    EmbeddedPostgres,
    EmbeddedRedis,
    free_port,
    postgres_answers,
    postgres_service,
    redis_service,
    wait_until,
)

LOCAL_TEST_DSN = "host=127.0.0.1 port=5432 user=postgres dbname=test"

__all__ = [
    "EmbeddedPostgres",
    "EmbeddedRedis",
    "free_port",
    "postgres_answers",
    "postgres_for_tests",
    "redis_for_tests",
    "wait_until",
]


@contextlib.contextmanager
def postgres_for_tests(base: Path) -> Iterator[str]:
    with postgres_service(base, "PGLOCK_TEST_DSN", LOCAL_TEST_DSN) as dsn:
        yield dsn


@contextlib.contextmanager
def redis_for_tests(base: Path) -> Iterator[str]:
    with redis_service(base, "PGLOCK_TEST_BROKER", LOCAL_BROKER) as url:
        yield url
