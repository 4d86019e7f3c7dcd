"""The fallback servers `make test` starts on a machine without Postgres or Redis."""

from __future__ import annotations

from pathlib import Path

import redis

from pglock_celery import try_lock
from tests.support.services import EmbeddedPostgres, EmbeddedRedis


def test_embedded_postgres_and_redis_start_serve_and_stop(tmp_path: Path) -> None:
    postgres = EmbeddedPostgres(tmp_path / "pg")
    cache = EmbeddedRedis(tmp_path / "redis")
    postgres.init()
    postgres.start()
    cache.start()
    try:
        with try_lock("embedded:check", dsn=postgres.dsn) as lock:
            assert lock.acquired and lock.held()
        client = redis.Redis.from_url(cache.url)
        assert client.ping()
        client.close()
    finally:
        cache.stop()
        postgres.destroy()
    assert not (tmp_path / "pg").exists()
