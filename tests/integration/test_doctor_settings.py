"""The doctor fails on an invalid pglock setting, naming it as written and the values it takes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pglock_celery.doctor import run_checks

ROOT = Path(__file__).resolve().parents[2]


def test_the_checks_fail_on_an_invalid_setting_naming_it(
    pg_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PGLOCK_ON_LOST", "kill")
    [finding] = [f for f in run_checks(pg_dsn) if f.check == "settings"]
    assert finding.level == "fail"
    assert "PGLOCK_ON_LOST='kill': must be 'interrupt', 'raise' or 'terminate'" in finding.message


def test_the_checks_pass_valid_settings(pg_dsn: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PGLOCK_ON_LOST", "terminate")
    [finding] = [f for f in run_checks(pg_dsn) if f.check == "settings"]
    assert finding.level == "ok"


def test_the_doctor_command_fails_on_an_invalid_setting(pg_dsn: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "pglock_celery.cli", "doctor", "--dsn", pg_dsn],
        cwd=ROOT, env={**os.environ, "PGLOCK_STRATEGY": "pooled"},
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode != 0, done.stdout
    assert "PGLOCK_STRATEGY='pooled': must be 'connect', 'reuse' or 'shared'" in (
        done.stdout + done.stderr
    )
