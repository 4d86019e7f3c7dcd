"""What a user installs: no Redis or psycopg implementation forced on them, a license."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import entry_points, metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
META = metadata("pglock-celery")


def test_the_hard_dependencies_are_celery_and_psycopg_without_extras() -> None:
    requires = META.get_all("Requires-Dist") or []
    hard = [r for r in requires if "extra ==" not in r]
    assert sorted(r.split(">")[0].split("<")[0] for r in hard) == ["celery", "psycopg"]

    def extra(name: str) -> list[str]:
        return [r.split(";")[0].strip() for r in requires if f"extra == '{name}'" in r]

    assert extra("redis") == ["celery[redis]<6,>=5.3"]
    assert [r.split(">")[0].split("<")[0] for r in extra("binary")] == ["psycopg[binary]"]
    assert [r.split(">")[0].split("<")[0] for r in extra("c")] == ["psycopg[c]"]


def test_the_package_imports_without_redis_for_a_rabbitmq_user() -> None:
    """Block every import of redis: pglock_celery and its CLI still load."""
    code = (
        "import sys; sys.modules['redis'] = None\n"
        "import pglock_celery, pglock_celery.cli, pglock_celery.celery_command\n"
        "print(pglock_celery.__version__)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr


def test_the_license_file_is_the_mit_license_the_metadata_names() -> None:
    assert META["License-Expression"] == "MIT"
    assert (ROOT / "LICENSE").read_text().startswith("MIT License\n")


def test_the_celery_command_is_registered_for_celery() -> None:
    found = [e for e in entry_points(group="celery.commands") if e.name == "pglock"]
    assert [e.value for e in found] == ["pglock_celery.celery_command:pglock"]
