"""What a warm call goes through, traced: a report of its modules and functions, and
no module on it that has no business there.

Traced with sys.setprofile over library frames only (bench/trace.py), in a process of
its own: a warm call of a worker, with nothing of a test run around it. The counts are
printed as a report, not held to a target (a helper that makes code clearer is worth a
function); what is held is that a warm call never reaches the holder lookup (pg_locks,
pg_stat_activity), the busy-session probe, the guard or the leader fence's module
unless it is configured.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
#: Modules a warm call without a fence never needs: their costs grow with the server's
#: sessions or locks, or belong to other questions.
OFF_THE_PATH = {
    "pglock_celery.inspect",
    "pglock_celery.probe",
    "pglock_celery.guard",
    "pglock_celery.leader",
    "pglock_celery.patroni",
    "pglock_celery.doctor",
}


@pytest.fixture(scope="module")
def paths(pg_dsn: str) -> dict[str, list[list[str]]]:
    done = subprocess.run(
        [sys.executable, "-m", "bench.trace", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={**os.environ, "PGLOCK_DSN": pg_dsn, "PYTHONPATH": str(ROOT)},
    )
    assert done.returncode == 0, done.stderr
    found: dict[str, list[list[str]]] = json.loads(done.stdout.strip().splitlines()[-1])
    return found


@pytest.mark.parametrize("path", ["lock cycle", "task call"])
def test_a_warm_call_takes_and_frees_its_lock_without_the_modules_off_its_path(
    paths: dict[str, list[list[str]]], path: str
) -> None:
    functions = paths[path]
    modules = {module for module, _ in functions}
    print(f"\n{path}: {len(modules)} modules, {len(functions)} functions: {sorted(modules)}")
    assert {"pglock_celery.lock", "pglock_celery.sources.dedicated"} <= modules
    assert not modules & OFF_THE_PATH, sorted(modules & OFF_THE_PATH)
