"""The worker tests of G1, G2 and the lock modes again, with RabbitMQ as the broker.

The tests themselves are test_workers.py's, imported here: only the broker changes.
This module's ``app`` and ``workers`` fixtures publish and consume through RabbitMQ
(results stay on Redis), and put the app back on Redis afterwards.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from celery import Celery

from tests.integration.test_workers import (
    test_retry_mode_retries_while_held_and_runs_once_free,
    test_sigkill_of_the_holding_child_frees_the_lock_within_100_ms,
    test_two_prefork_workers_never_overlap_on_a_tenant,
    test_wait_mode_makes_the_second_call_wait_then_run,
    test_wait_mode_raises_lock_timeout_after_lock_timeout,
)
from tests.support.rabbitmq import delete_queues, rabbitmq_for_tests
from tests.support.workers import Worker

__all__ = [
    "test_retry_mode_retries_while_held_and_runs_once_free",
    "test_sigkill_of_the_holding_child_frees_the_lock_within_100_ms",
    "test_two_prefork_workers_never_overlap_on_a_tenant",
    "test_wait_mode_makes_the_second_call_wait_then_run",
    "test_wait_mode_raises_lock_timeout_after_lock_timeout",
]


@pytest.fixture(scope="module")
def amqp_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with rabbitmq_for_tests(tmp_path_factory.mktemp("rabbitmq")) as url:
        yield url


def _use_broker(app: Celery, url: str) -> None:
    """Point the app's producers and control at ``url``.

    The pools are kombu's, one per URL for the whole process: they are left open
    (closing the Redis one would break every later test that publishes), only the
    app's references to them go.
    """
    app._pool = None
    app.amqp._producer_pool = None
    app.conf.broker_url = url


@pytest.fixture(scope="module")
def app(app: Celery, amqp_url: str, queue: str) -> Iterator[Celery]:
    """The session's test app, publishing through RabbitMQ for this module."""
    redis_url = app.conf.broker_url
    _use_broker(app, amqp_url)
    assert app.connection_for_write().transport_cls in ("amqp", "pyamqp")
    try:
        yield app
    finally:
        _use_broker(app, redis_url)
        delete_queues(amqp_url, queue)


@pytest.fixture(scope="module")
def workers(
    app: Celery, amqp_url: str, worker_env: dict[str, str], log_dir: Path
) -> Iterator[list[Worker]]:
    """Two prefork workers consuming from RabbitMQ (CELERY_BROKER_URL wins over the app's)."""
    env = {**worker_env, "CELERY_BROKER_URL": amqp_url}
    started: list[Worker] = []
    try:
        for _ in range(2):
            started.append(Worker(app, "tests.apps.core", env, log_dir, concurrency=2))
        transports = {
            line.split("transport:")[-1].strip()
            for worker in started
            for line in worker.log.read_text().splitlines()
            if "transport:" in line
        }
        assert transports and all(t.startswith("amqp://") for t in transports), transports
        yield started
    finally:
        for worker in started:
            worker.stop()


def test_the_module_runs_on_rabbitmq(app: Celery, amqp_url: str) -> None:
    """The imported tests publish through RabbitMQ, not the session's Redis."""
    with app.connection_for_write() as conn:
        assert conn.as_uri().startswith("amqp://")
        assert conn.as_uri().split("@")[-1] == amqp_url.split("@")[-1]
    assert os.environ.get("CELERY_BROKER_URL") is None  # only the workers get it
