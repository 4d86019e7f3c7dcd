"""G4: a worker that cannot reach the lock database never runs a step body."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from celery import Celery

from pglock_celery import LockUnavailable
from tests.apps import core
from tests.helpers.workers import Worker

PASSWORD = "s3cret-pw"
UNREACHABLE = f"postgresql://app:{PASSWORD}@127.0.0.1:1/test"
SUFFIX = "-unreachable"


@pytest.fixture(scope="module")
def blind_worker(app: Celery, worker_env: dict[str, str], log_dir: Path) -> Iterator[Worker]:
    """A worker whose pglock_dsn points at a port where nothing listens."""
    env = {
        **worker_env,
        "PGLOCK_DSN": UNREACHABLE,
        "PGLOCK_TEST_QUEUE": worker_env["PGLOCK_TEST_QUEUE"] + SUFFIX,
    }
    worker = Worker(app, "tests.apps.core", env, log_dir, concurrency=1)
    yield worker
    worker.stop()


def test_unreachable_database_fails_the_call_and_never_runs_the_body(
    blind_worker: Worker, queue: str, broker_url: str, run_id: str
) -> None:
    marker = f"marker:{run_id}"
    call = core.mark.apply_async((run_id, marker), queue=queue + SUFFIX)
    with pytest.raises(LockUnavailable) as raised:
        call.get(timeout=60)
    message = str(raised.value)
    assert "127.0.0.1:1" in message
    assert PASSWORD not in message
    assert redis.Redis.from_url(broker_url).get(marker) is None
    assert PASSWORD not in blind_worker.log.read_text(errors="replace")


def test_autoretry_for_lock_unavailable_retries_then_fails(
    blind_worker: Worker, queue: str, broker_url: str, run_id: str
) -> None:
    marker = f"marker:{run_id}"
    call = core.mark_with_retries.apply_async((run_id, marker), queue=queue + SUFFIX)
    with pytest.raises(LockUnavailable, match=r"127\.0\.0\.1:1"):
        call.get(timeout=60)
    client = redis.Redis.from_url(broker_url)
    assert client.get(f"retries:{call.id}") == b"2"
    assert client.get(marker) is None
