"""A worker with an invalid pglock setting or TenantLockedTask option refuses to start.

Real `celery worker` processes: each must exit non-zero before its pool starts,
naming the setting as written or the task and its option, and why.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[2]


class Started:
    """A `celery worker` started by a test, whose whole process tree the test ends."""

    def __init__(self, module: str, env: dict[str, str], cwd: Path) -> None:
        command = [
            sys.executable, "-m", "celery", "-A", module, "worker", "-P", "prefork", "-c", "1",
            "-Q", env["PGLOCK_TEST_QUEUE"], "--loglevel=INFO", "--without-gossip",
            "--without-mingle", "--without-heartbeat",
        ]  # fmt: skip
        self.process = subprocess.Popen(
            command,
            cwd=cwd,
            env={**os.environ, "PYTHONPATH": f"{cwd}{os.pathsep}{ROOT}", **env},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )

    def outcome(self, timeout: float = 60) -> tuple[int | None, str]:
        """Its exit status and output; None as status if it was still running after ``timeout``."""
        try:
            output, _ = self.process.communicate(timeout=timeout)
            return self.process.returncode, output
        except subprocess.TimeoutExpired:
            self.end()
            output, _ = self.process.communicate()
            return None, output

    def end(self) -> None:
        if self.process.poll() is not None:
            return
        try:
            tree = [child.pid for child in psutil.Process(self.process.pid).children(True)]
        except psutil.NoSuchProcess:
            tree = []
        for pid in [self.process.pid, *tree]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.process.wait()


@pytest.fixture
def start(worker_env: dict[str, str]) -> Iterator[object]:
    started: list[Started] = []

    def run(module: str, cwd: Path = ROOT, **env: str) -> tuple[int | None, str]:
        worker = Started(module, {**worker_env, **env}, cwd)
        started.append(worker)
        return worker.outcome()

    yield run
    for worker in started:
        worker.end()


def refused(status: int | None, output: str) -> bool:
    return status not in (None, 0) and "refuses to start" in output and " ready." not in output


@pytest.mark.parametrize(
    ("variable", "value", "why"),
    [
        ("PGLOCK_ON_LOST", "kill", "must be 'interrupt', 'raise' or 'terminate'"),
        ("PGLOCK_STRATEGY", "pooled", "must be 'connect', 'reuse' or 'shared'"),
    ],
)
def test_a_worker_refuses_to_start_with_an_invalid_setting_naming_it(
    start: object, variable: str, value: str, why: str
) -> None:
    status, output = start("tests.apps.core", **{variable: value})  # type: ignore[operator]
    assert refused(status, output), (status, output[-3000:])
    assert f"{variable}='{value}': {why}" in output


def test_a_worker_refuses_to_start_with_a_bad_task_option_naming_task_and_option(
    start: object, tmp_path: Path
) -> None:
    (tmp_path / "misconfigured.py").write_text(
        "from tests.apps.core import app\n"
        "from pglock_celery import TenantLockedTask\n"
        "@app.task(base=TenantLockedTask, lock_name='sync:{customer}')\n"
        "def sync(account_id):\n"
        "    return 'ran'\n"
        "@app.task(base=TenantLockedTask, lock_mode='block')\n"
        "def onboard(tenant_id):\n"
        "    return 'ran'\n"
    )
    status, output = start("misconfigured", cwd=tmp_path)  # type: ignore[operator]
    assert refused(status, output), (status, output[-3000:])
    assert (
        "task misconfigured.sync: lock_name 'sync:{customer}' names argument 'customer', "
        "which the task cannot take (its parameters: account_id)"
    ) in output
    assert "task misconfigured.onboard: lock_mode must be one of skip, wait, retry" in output


@pytest.mark.parametrize(
    ("dsn", "why"),
    [
        ("", "no lock database configured: set the Celery setting pglock_dsn"),
        ("host=db port=x5432", "not a valid connection string"),
        ("postgresql://app:s3cret@db:5432/app?bogus_option=1", "not a valid connection string"),
        ("postgresql://app:s3cret/7Zq@127.0.0.1:1/app", "an '@' after the host part of a URI"),
    ],
)
def test_a_worker_without_a_usable_lock_dsn_refuses_to_start_naming_the_setting(
    start: object, dsn: str, why: str
) -> None:
    status, output = start("tests.apps.core", PGLOCK_DSN=dsn)  # type: ignore[operator]
    assert refused(status, output), (status, output[-3000:])
    assert why in output and "pglock_dsn" in output
    assert "s3cret" not in output
