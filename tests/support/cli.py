"""The pglock-celery command, run as a user runs it."""

from __future__ import annotations

import os
import subprocess
import sys


def cli(*args: str, dsn: str | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``pglock-celery *args`` with PGLOCK_DSN set to ``dsn`` (unset when None)."""
    env = {k: v for k, v in os.environ.items() if k != "PGLOCK_DSN"}
    if dsn is not None:
        env["PGLOCK_DSN"] = dsn
    return subprocess.run(
        [sys.executable, "-m", "pglock_celery.cli", *args],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
