"""`celery report` and `celery inspect conf` never show a DSN's password, whatever the
Celery namespace of the settings (here ``PROJ``: ``PROJ_PGLOCK_SHARDS``)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.apps import namespaced
from tests.support.workers import ROOT, Worker

SECRET = "namespaced-s3cret"


@pytest.fixture
def env(worker_env: dict[str, str], run_id: str) -> dict[str, str]:
    queue = f"{worker_env['PGLOCK_TEST_QUEUE']}-namespaced-{run_id}"
    shards = {k: v for k, v in worker_env.items() if k != "PGLOCK_DSN"}  # the shards instead
    return {
        **shards,
        "PGLOCK_TEST_QUEUE": queue,
        "PGLOCK_TEST_SHARD_DSN": worker_env["PGLOCK_DSN"],
        "PGLOCK_TEST_SECRET": SECRET,
    }


@pytest.fixture
def worker(env: dict[str, str], log_dir: Path) -> Iterator[Worker]:
    namespaced.app.conf.broker_url = env["PGLOCK_TEST_BROKER"]
    started = Worker(namespaced.app, "tests.apps.namespaced", env, log_dir, concurrency=1)
    yield started
    started.stop()


def _celery(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "celery", "-A", "tests.apps.namespaced", *args],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), **env},
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def test_celery_report_masks_both_shard_maps_under_any_namespace(env: dict[str, str]) -> None:
    done = _celery(env, "report")
    assert done.returncode == 0, done.stderr
    assert "PROJ_PGLOCK_SHARDS" in done.stdout and "PROJ_PGLOCK_SHARDS_PREVIOUS" in done.stdout
    assert SECRET not in done.stdout + done.stderr, done.stdout


def test_inspect_conf_of_a_real_worker_masks_both_shard_maps(
    worker: Worker, env: dict[str, str]
) -> None:
    done = _celery(env, "inspect", "conf", "-d", worker.nodename, "--timeout", "10")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "PROJ_PGLOCK_SHARDS" in done.stdout and "PROJ_PGLOCK_SHARDS_PREVIOUS" in done.stdout
    assert SECRET not in done.stdout + done.stderr, done.stdout
