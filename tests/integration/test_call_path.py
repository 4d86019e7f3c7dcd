"""A warm call crosses few library modules and functions (the core stays one a person can hold).

Counted with a sys.setprofile trace of library frames only (bench/trace.py), in a
process of its own: a warm call of a worker, with nothing of a test run around it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
#: The bounds of issue 17: library modules and distinct functions on one warm call.
MAX_MODULES = 7
MAX_FUNCTIONS = 30


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
def test_a_warm_call_crosses_at_most_seven_modules_and_thirty_functions(
    paths: dict[str, list[list[str]]], path: str
) -> None:
    functions = paths[path]
    modules = {module for module, _ in functions}
    assert len(modules) <= MAX_MODULES, sorted(modules)
    assert len(functions) <= MAX_FUNCTIONS, functions
