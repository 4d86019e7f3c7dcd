"""Two `make test` runs on one machine's servers at once both pass."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from tests.support.workers import ROOT


def test_two_runs_on_the_same_servers_at_once_both_pass(
    pg_server: str, redis_server: str, tmp_path: Path
) -> None:
    """Each holds the same lock name and writes the same Redis key while the other does."""
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    runs = {}
    started = time.monotonic()
    for name in ("a", "b"):
        env = {
            **os.environ,
            "PGLOCK_TEST_DSN": pg_server,
            "PGLOCK_TEST_BROKER": redis_server,
            "PGLOCK_ALONGSIDE_DIR": str(barrier),
            "PGLOCK_ALONGSIDE_NAME": name,
        }
        runs[name] = subprocess.Popen(
            [
                sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                f"--basetemp={tmp_path / name}", "tests/integration/alongside.py",
            ],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
    outputs = {name: run.communicate(timeout=240)[0] for name, run in runs.items()}
    print(f"\ntwo runs at once on the same servers: {time.monotonic() - started:.1f} s")
    for name, run in runs.items():
        assert run.returncode == 0, f"run {name} failed:\n{outputs[name][-3000:]}"
        assert "1 passed" in outputs[name]
