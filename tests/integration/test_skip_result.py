"""A skip returns a small typed result, its holder's details go in the event and the log,
and a retry of lock_mode "retry" is logged as a retry (real workers, prefork and threads)."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery

from pglock_celery import LOCK_SKIPPED_EVENT, LockTimeout, SkipHolder, SkipResult, skipped
from pglock_celery.config import PglockConfig
from pglock_celery.lock import AdvisoryLock
from tests.apps import core
from tests.support.services import wait_until
from tests.support.workers import Worker

RESULT_TIMEOUT = 30
#: The stored skip result, in bytes at most (Celery's envelope included): small
#: whatever the holder (it held about 700 with the holder's every field).
SMALL = 450


@pytest.fixture(scope="module", params=["prefork", "threads"])
def skip_worker(
    request: pytest.FixtureRequest, app: Celery, worker_env: dict[str, str], log_dir: Path
) -> Iterator[tuple[Worker, str]]:
    queue = f"{worker_env['PGLOCK_TEST_QUEUE']}-skips-{request.param}"
    env = {**worker_env, "PGLOCK_TEST_QUEUE": queue}
    worker = Worker(app, "tests.apps.core", env, log_dir, pool=request.param, extra=("-E",))
    try:
        yield worker, queue
    finally:
        worker.stop()


class Events:
    """A real event receiver on the broker, in a thread of its own, ready once it returns."""

    def __init__(self, app: Celery) -> None:
        self.app = app
        self.seen: list[dict[str, Any]] = []
        self._connection = app.connection_for_read()
        self._receiver = app.events.Receiver(self._connection, handlers={"*": self.seen.append})
        threading.Thread(target=self._run, daemon=True).start()
        probe = f"probe-{uuid.uuid4().hex}"

        def probed() -> bool:
            with app.events.default_dispatcher() as dispatcher:
                dispatcher.send("pglock-test-probe", uuid=probe)
            return any(event.get("uuid") == probe for event in self.seen)

        wait_until(probed, 20, "the event receiver to listen", 0.2)

    def _run(self) -> None:
        try:
            self._receiver.capture(limit=None, timeout=None, wakeup=False)
        finally:
            self._connection.release()

    def of(self, kind: str, task_id: str) -> list[dict[str, Any]]:
        return [e for e in self.seen if e.get("type") == kind and e.get("uuid") == task_id]

    def stop(self) -> None:
        self._receiver.should_stop = True  # seen within a second


def test_a_skip_stores_a_small_typed_result_and_puts_the_holder_in_the_event_and_log(
    skip_worker: tuple[Worker, str], app: Celery, history: str, pg_dsn: str, run_id: str
) -> None:
    worker, queue = skip_worker
    events = Events(app)
    try:
        tenant, holder_task = f"{run_id}-skip", str(uuid.uuid4())
        held = AdvisoryLock(
            f"tenant:{tenant}", config=PglockConfig(dsn=pg_dsn), task_id=holder_task
        )
        with held:
            assert held.acquired
            backend = held.backend_pid
            call = core.step.apply_async((tenant, history), queue=queue)
            result = call.get(timeout=RESULT_TIMEOUT)
            ran = core.step.apply_async((f"{run_id}-free", history), queue=queue)
            real = ran.get(timeout=RESULT_TIMEOUT)
        assert skipped(result) and not skipped(real)
        assert set(result) == SkipResult.__required_keys__
        assert set(result["holder"]) == SkipHolder.__required_keys__
        assert result["lock"] == f"tenant:{tenant}"
        assert result["holder"]["task_id"] == holder_task
        assert result["holder"]["backend_pid"] == backend
        stored = redis.Redis.from_url(app.conf.result_backend).get(f"celery-task-meta-{call.id}")
        assert stored is not None
        print(f"\nstored skip result: {len(stored)} bytes: {stored.decode()}")
        assert len(stored) <= SMALL and b"application_name" not in stored

        # Everything Postgres said about the holder is in the event, and the log names it.
        [event] = wait_until(
            lambda: events.of(LOCK_SKIPPED_EVENT, call.id), 20, "the skip event", 0.1
        )
        assert event["holder"]["application_name"].endswith(f"|tenant:{tenant}")
        assert {k: event["holder"][k] for k in result["holder"]} == result["holder"]
        wait_until(
            lambda: f"is held by task {holder_task} (" in worker.log.read_text(),
            20,
            "the skip's log line naming its holder",
        )
    finally:
        events.stop()


def test_a_retry_is_logged_as_a_retry_with_when_and_what_is_left(
    skip_worker: tuple[Worker, str], history: str, pg_dsn: str, run_id: str
) -> None:
    """lock_mode "retry" (max_retries=2): each retry's log lines say it retries, when, and
    how many are left; only the last attempt fails with LockTimeout."""
    worker, queue = skip_worker
    tenant = f"{run_id}-retry"
    held = AdvisoryLock(f"tenant:{tenant}", config=PglockConfig(dsn=pg_dsn))
    with held:
        call = core.retry_briefly.apply_async((tenant, history), queue=queue)
        with pytest.raises(LockTimeout, match=f"tenant:{tenant} was still held after 2 retries"):
            call.get(timeout=RESULT_TIMEOUT)

    def retry_lines() -> list[str] | None:
        lines = [
            line
            for line in worker.log.read_text().splitlines()
            if call.id in line and f"lock tenant:{tenant} is held by" in line
        ]
        return lines if len(lines) >= 4 else None  # ours and Celery's, for 2 retries

    lines = wait_until(retry_lines, 20, "the retries' log lines")
    print("\n" + "\n".join(lines))
    for n, left in ((1, 1), (2, 0)):
        said = [line for line in lines if f"retry {n} of 2 ({left} left after it)" in line]
        assert len(said) == 2, lines  # ours, and Celery's "Task ...[id] retry: ..."
        assert all(" in 0.1 s (at 20" in line for line in said), said
    assert any(f"[{call.id}] retry: lock tenant:{tenant} is held by" in line for line in lines)
    assert any(f"[{call.id}] retries in 0.1 s" in line for line in lines)
    assert "after 0 retries" not in worker.log.read_text()
