"""`celery -A proj pglock ...` and `pglock-celery -A proj ...` read pglock_dsn from the app."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pglock_celery
from pglock_celery import lock_key, try_lock

ROOT = Path(__file__).resolve().parents[2]


def run(*command: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """A command as a user types it, from the project root, without PGLOCK_DSN of ours."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("PGLOCK_", "CELERY_"))}
    return subprocess.run(
        command, cwd=ROOT, env={**base, "PYTHONPATH": str(ROOT), **env},
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def celery(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return run(sys.executable, "-m", "celery", *args, env=env)


def test_celery_pglock_locks_json_lists_a_held_lock_from_the_apps_dsn(
    pg_dsn: str, run_id: str
) -> None:
    """The tasks app takes pglock_dsn from celeryconfig (PGLOCK_DSN feeds it, not the command)."""
    name = f"training:{run_id}"
    with try_lock(name, dsn=pg_dsn) as held:
        assert held.acquired
        backend_pid = held.connection.info.backend_pid
        done = celery("-A", "tasks", "pglock", "locks", "--json", env={"PGLOCK_DSN": pg_dsn})
    assert done.returncode == 0, done.stderr
    rows = {row["key"]: row for row in json.loads(done.stdout)}
    assert rows[lock_key(name)]["name"] == name
    assert rows[lock_key(name)]["backend_pid"] == backend_pid


def test_the_apps_setting_wins_over_the_environment(pg_dsn: str, tmp_path: Path) -> None:
    """pglock_dsn set on the app is used even when PGLOCK_DSN points elsewhere."""
    (tmp_path / "proj.py").write_text(
        f"from celery import Celery\napp = Celery('proj')\napp.conf.pglock_dsn = {pg_dsn!r}\n"
    )
    env = {"PYTHONPATH": f"{tmp_path}:{ROOT}", "PGLOCK_DSN": "host=127.0.0.1 port=1 dbname=nowhere"}
    with try_lock("cli-app-wins", dsn=pg_dsn) as held:
        assert held.acquired
        for command in (
            (sys.executable, "-m", "celery", "-A", "proj", "pglock", "locks", "--json"),
            (sys.executable, "-m", "pglock_celery.cli", "-A", "proj", "locks", "--json"),
        ):
            done = run(*command, env=env)
            assert done.returncode == 0, done.stderr
            keys = {row["key"] for row in json.loads(done.stdout)}
            assert lock_key("cli-app-wins") in keys


def test_an_app_that_cannot_load_is_one_line_and_exit_2() -> None:
    done = run(sys.executable, "-m", "pglock_celery.cli", "-A", "no_such_proj", "locks", env={})
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "pglock-celery: error: cannot load the Celery app 'no_such_proj': "
        "ModuleNotFoundError: No module named 'no_such_proj'"
    ]


def test_version_on_both_commands_is_the_packages() -> None:
    version = pglock_celery.__version__
    assert version.count(".") == 2
    mine = run(sys.executable, "-m", "pglock_celery.cli", "--version", env={})
    assert mine.stdout.strip() == f"pglock-celery {version}"
    theirs = celery("pglock", "--version", env={})
    assert theirs.returncode == 0, theirs.stderr
    assert theirs.stdout.strip() == f"celery pglock {version}"
    from importlib.metadata import version as installed

    assert installed("pglock-celery") == version


def test_celery_lists_the_pglock_command_and_passes_help_through() -> None:
    listing = celery("--help", env={})
    assert any(line.split()[:1] == ["pglock"] for line in listing.stdout.splitlines())
    helped = celery("pglock", "key", "--help", env={})
    assert helped.returncode == 0
    assert helped.stdout.startswith("usage: celery pglock key")
    key = celery("pglock", "key", "tenant:42", env={})
    assert key.stdout.strip() == str(lock_key("tenant:42"))


def test_a_django_projects_celery_pglock_dsn_is_read(pg_dsn: str, tmp_path: Path) -> None:
    """The README's Django layout: CELERY_PGLOCK_DSN in settings, namespace="CELERY"."""
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "__init__.py").write_text("from .celery import app\n")
    (proj / "settings.py").write_text(
        f"SECRET_KEY = 'test'\nUSE_TZ = True\nINSTALLED_APPS = []\nCELERY_PGLOCK_DSN = {pg_dsn!r}\n"
    )
    (proj / "celery.py").write_text(
        "import os\n"
        "from celery import Celery\n"
        "os.environ.setdefault('DJANGO_SETTINGS_MODULE', 'proj.settings')\n"
        "app = Celery('proj')\n"
        "app.config_from_object('django.conf:settings', namespace='CELERY')\n"
    )
    env = {"PYTHONPATH": f"{tmp_path}:{ROOT}"}
    with try_lock("django-project-lock", dsn=pg_dsn) as held:
        assert held.acquired
        done = celery("-A", "proj", "pglock", "locks", "--json", env=env)
    assert done.returncode == 0, done.stderr
    assert lock_key("django-project-lock") in {row["key"] for row in json.loads(done.stdout)}
