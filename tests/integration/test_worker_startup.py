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

import django
import psutil
import pytest
from celery import Celery
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from pglock_celery.dsn import describe_target
from tests.support.services import free_port, wait_until
from tests.support.workers import Worker

ROOT = Path(__file__).resolve().parents[2]


class Started:
    """A `celery worker` started by a test, whose whole process tree the test ends."""

    def __init__(
        self, module: str, env: dict[str, str], cwd: Path, python: tuple[str, ...]
    ) -> None:
        command = [
            *python, "-m", "celery", "-A", module, "worker", "-P", "prefork", "-c", "1",
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

    def run(
        module: str, cwd: Path = ROOT, python: tuple[str, ...] = (sys.executable,), **env: str
    ) -> tuple[int | None, str]:
        worker = Started(module, {**worker_env, **env}, cwd, python)
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
        ("host=db port=x5432", "DSN (PGLOCK_DSN) is not a valid connection string"),
        (
            "postgresql://app:s3cret@db:5432/app?bogus_option=1",
            "DSN (PGLOCK_DSN) is not a valid connection string",
        ),
        ("postgresql://app:s3cret/7Zq@127.0.0.1:1/app", "an '@' after the host part of a URI"),
    ],
)
def test_a_worker_without_a_usable_lock_dsn_refuses_to_start_naming_the_setting(
    start: object, dsn: str, why: str
) -> None:
    """The variable that gave the malformed DSN, or the setting an app without one would read."""
    status, output = start("tests.apps.core", PGLOCK_DSN=dsn)  # type: ignore[operator]
    assert refused(status, output), (status, output[-3000:])
    assert why in output and ("PGLOCK_DSN" if dsn else "pglock_dsn") in output
    assert "s3cret" not in output


def site_without_django(where: Path) -> Path:
    """A directory holding every installed distribution but Django (links to them)."""
    site = Path(django.__file__).resolve().parents[1]
    where.mkdir()
    for entry in site.iterdir():
        name = entry.name.lower()
        if name == "django" or (name.startswith("django-") and name.endswith(".dist-info")):
            continue
        (where / entry.name).symlink_to(entry)
    return where


def test_a_worker_without_django_refuses_to_start_saying_to_install_it(
    start: object, tmp_path: Path
) -> None:
    """PGLOCK_DATABASE names a Django alias; the worker's sys.path has no Django: one line."""
    site = site_without_django(tmp_path / "site")
    path = os.pathsep.join([str(ROOT), str(site)])
    python = (sys.executable, "-S")  # no site-packages but the one given, where Django is not
    hidden = subprocess.run(
        [*python, "-c", "import celery, psycopg\nimport django"],
        env={**os.environ, "PYTHONPATH": path},
        capture_output=True,
        text=True,
    )
    assert "No module named 'django'" in hidden.stderr, hidden.stderr
    status, output = start(  # type: ignore[operator]
        "tests.apps.core", python=python, PYTHONPATH=path, PGLOCK_DATABASE="default"
    )
    assert refused(status, output), (status, output[-3000:])
    reason = next(line for line in output.splitlines() if "PGLOCK_DATABASE" in line)
    assert "invalid setting PGLOCK_DATABASE='default'" in reason
    assert "pip install django" in reason
    assert "Traceback" not in output and "ModuleNotFoundError" not in output, output[-3000:]


def started_and_logged(app: Celery, env: dict[str, str], log_dir: Path, *wanted: str) -> str:
    """Start a worker under ``env`` (it answers a ping), wait for every text of ``wanted`` in
    its log, stop it; its log."""
    worker = Worker(app, "tests.apps.core", env, log_dir, concurrency=1)
    try:
        wait_until(
            lambda: all(text in worker.log.read_text(errors="replace") for text in wanted),
            30,
            f"the worker to log {wanted}",
        )
        return worker.log.read_text(errors="replace")
    finally:
        worker.stop()


def test_a_worker_says_at_start_where_its_locks_live_without_the_password(
    app: Celery, worker_env: dict[str, str], log_dir: Path, pg_dsn: str
) -> None:
    """One line naming host, port, database and strategy; the DSN's password nowhere."""
    params = conninfo_to_dict(pg_dsn)
    dsn = make_conninfo(pg_dsn, password="s3cret-startup-pw")
    env = {**worker_env, "PGLOCK_DSN": dsn, "PGLOCK_STRATEGY": "connect"}
    log = started_and_logged(app, env, log_dir, "pglock-celery: locks on ")
    line = next(line for line in log.splitlines() if "pglock-celery: locks on " in line)
    assert describe_target(dsn) in line and "strategy connect" in line, line
    assert str(params["dbname"]) in line
    assert "s3cret-startup-pw" not in log
    assert "cannot be reached" not in log  # trust auth: the password is not asked for


def test_a_worker_warns_at_start_when_its_lock_database_cannot_be_reached(
    app: Celery, worker_env: dict[str, str], log_dir: Path
) -> None:
    """Nothing listens on the DSN's port: a warning that locked tasks fail closed, the
    worker up all the same (it answers while the check runs)."""
    dsn = f"host=127.0.0.1 port={free_port()} dbname=nowhere password=s3cret-startup-pw"
    env = {**worker_env, "PGLOCK_DSN": dsn}
    log = started_and_logged(app, env, log_dir, "cannot be reached")
    warning = next(line for line in log.splitlines() if "cannot be reached" in line)
    assert "WARNING" in warning and describe_target(dsn) in warning, warning
    assert "fails closed" in warning
    assert "s3cret-startup-pw" not in log
