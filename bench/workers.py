"""Real `celery worker` processes for the benchmarks, started and always stopped."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

from tasks.services import stop_process, wait_until

ROOT = Path(__file__).resolve().parents[1]


@contextlib.contextmanager
def worker(
    env: dict[str, str],
    logs: Path,
    concurrency: int = 2,
    pool: str = "prefork",
    prefetch_multiplier: int = 4,
) -> Iterator[Path]:
    """A worker of bench.app on ``env["PGLOCK_BENCH_QUEUE"]``; yields its log once it answers.

    A prefetch multiplier of 1 keeps a worker from reserving calls that other
    workers of the same queue should run at the same time.
    """
    from bench.app import app

    name = f"bench{uuid.uuid4().hex[:6]}@%h"
    path = logs / f"{name.split('@')[0]}.log"
    log = path.open("wb")
    process = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "bench.app", "worker", "-P", pool,
         "-c", str(concurrency), "-n", name, "--loglevel=WARNING", "--without-gossip",
         "--without-mingle", "--without-heartbeat", "-Q", env["PGLOCK_BENCH_QUEUE"],
         f"--prefetch-multiplier={prefetch_multiplier}"],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), **env}, stdout=log,
        stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        node = name.replace("%h", socket.gethostname())

        def answers() -> bool:
            if process.poll() is not None:
                raise RuntimeError(f"worker {node} exited early: see {log.name}")
            return bool(app.control.ping([node], timeout=0.5))

        wait_until(answers, 60, f"worker {node}")
        yield path
    finally:
        stop_process(process, 30)
        log.close()
