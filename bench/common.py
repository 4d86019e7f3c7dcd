"""What the benchmark's questions share: the data files, the services, small helpers.

Each question (``bench.latency``, ``bench.throughput``, ...) measures on the
services of :func:`services` and stores its figures with :func:`save` as
``bench/results/<name>.json``; ``bench.report`` renders BENCHMARKS.md from those
files alone. This module imports no question and no renderer.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import platform
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg

from bench.server import bench_postgres
from pglock_celery.config import PglockConfig
from pglock_celery.sources import registry
from tasks.services import redis_service

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
#: The whole run's description (machine, versions, server, duration): written by a
#: ``make bench`` of every question, read by the renderer for the page's header.
RUN = "run"
NOT_AVAILABLE = "not available on this build"


# --- the data files -----------------------------------------------------------------------


def path(name: str, results: Path | None = None) -> Path:
    return (results or RESULTS) / f"{name}.json"


def save(name: str, data: dict[str, Any], results: Path | None = None) -> Path:
    """Write one question's figures (``data`` has its ``meta``) as ``<name>.json``."""
    out = path(name, results)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=1, sort_keys=False) + "\n")
    return out


def load(name: str, results: Path | None = None) -> dict[str, Any] | None:
    """One question's stored figures, or None when it was never measured."""
    found = path(name, results)
    if not found.exists():
        return None
    data: dict[str, Any] = json.loads(found.read_text())
    return data


@dataclass
class Context:
    """Where a question measures: the benchmark's Postgres and Redis, a scratch folder."""

    dsn: str
    broker: str
    work: Path
    #: Identifies one invocation: sections measured together share it.
    run_id: str
    #: The command that measured, as a reader would type it.
    command: str


def meta(ctx: Context, started: float) -> dict[str, Any]:
    """What every data file records about how it was measured."""
    return {
        "run": ctx.run_id,
        "command": ctx.command,
        "date": dt.date.today().isoformat(),
        "seconds": round(time.perf_counter() - started, 1),
        "server": server_description(ctx.dsn),
    }


def machine() -> dict[str, Any]:
    """The machine and the versions the figures were measured with."""
    import celery
    import kombu
    import redis

    return {
        "machine": platform.machine(),
        "cores": os.cpu_count(),
        "system": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "celery": celery.__version__,
        "kombu": kombu.__version__,
        "psycopg": psycopg.__version__,
        "redis_py": redis.__version__,
    }


def server_description(dsn: str) -> str:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT current_setting('server_version'), current_setting('max_connections')"
        ).fetchone()
    assert row is not None
    own = "" if os.environ.get("PGLOCK_BENCH_DSN") else " of the benchmark's own"
    return f"PostgreSQL {row[0]}{own} (max_connections {row[1]})"


@contextlib.contextmanager
def services(work: Path, command: str, dsn: str | None = None) -> Iterator[Context]:
    """The benchmark's Postgres (``dsn``, ``PGLOCK_BENCH_DSN``, else its own) and Redis."""
    with contextlib.ExitStack() as stack:
        dsn = dsn or stack.enter_context(bench_postgres(work / "pg"))
        broker = stack.enter_context(redis_service(work / "redis", "PGLOCK_BENCH_BROKER"))
        os.environ["PGLOCK_BENCH_BROKER"] = broker
        yield Context(dsn, broker, work, uuid.uuid4().hex[:12], command)


# --- helpers of several questions -----------------------------------------------------------


def close_sessions() -> None:
    """Close this process's idle and shared lock sessions (they hold nothing)."""
    registry.close()


def shared_config(dsn: str) -> PglockConfig | None:
    """The ``shared`` strategy with 4 sessions, or None on a build without it."""
    try:
        return PglockConfig(dsn=dsn, strategy="shared", shared_sessions=4)
    except TypeError:
        return None


def strategies(dsn: str) -> tuple[str, ...]:
    """The lock strategies of this build."""
    return ("reuse", "shared", "connect") if shared_config(dsn) else ("reuse", "connect")


def server_pid(dsn: str) -> int | None:
    """The Postgres server's main process, when it runs on this machine."""
    import psutil

    with psycopg.connect(dsn, autocommit=True) as conn:
        backend = conn.info.backend_pid
    try:
        parent = psutil.Process(backend).parent()
    except psutil.Error:
        return None
    return parent.pid if parent is not None and "postgres" in parent.name() else None


def server_cpu_ns(pid: int | None) -> int:
    """CPU nanoseconds the server's processes (live backends included) have run so far.

    From /proc/<pid>/schedstat (nanoseconds, where /proc/<pid>/stat counts clock
    ticks); 0 for a server not on this machine.
    """
    import psutil

    if pid is None:
        return 0
    total = 0
    try:
        processes = [pid, *(child.pid for child in psutil.Process(pid).children())]
    except psutil.Error:
        return 0
    for found in processes:
        with contextlib.suppress(OSError, ValueError, IndexError):
            total += int(Path(f"/proc/{found}/schedstat").read_text().split()[0])
    return total


def timed(once: Callable[[], object], count: int) -> list[float]:
    """Seconds of each of ``count`` calls of ``once``."""
    samples = []
    for _ in range(count):
        began = time.perf_counter()
        once()
        samples.append(time.perf_counter() - began)
    return samples


def settled(count: Callable[[], int], timeout: float = 30.0) -> int:
    """``count()`` once it has not changed for a second (sessions still closing)."""
    deadline = time.monotonic() + timeout
    last, since = count(), time.monotonic()
    while time.monotonic() < deadline and time.monotonic() - since < 1.0:
        time.sleep(0.2)
        now = count()
        if now != last:
            last, since = now, time.monotonic()
    return last


#: Foreign holders: the 10,000 locks are spread over this many sessions.
FOREIGN_SESSIONS = 10


class ForeignLocks:
    """Other sessions that hold 0 or more advisory locks (none of them the library's)."""

    def __init__(self, dsn: str) -> None:
        self.sessions = [psycopg.connect(dsn, autocommit=True) for _ in range(FOREIGN_SESSIONS)]

    def hold(self, count: int) -> None:
        """Hold ``count`` locks in all, instead of those held before."""
        per = count // FOREIGN_SESSIONS
        # Every session lets go first: the ranges of two counts overlap across sessions.
        for conn in self.sessions:
            conn.execute("SELECT pg_advisory_unlock_all()")
        for n, conn in enumerate(self.sessions):
            if per:
                conn.execute(
                    "SELECT count(pg_advisory_lock(k)) FROM generate_series(%s::int8, %s::int8) k",
                    (2**40 + n * per, 2**40 + (n + 1) * per - 1),
                )

    def close(self) -> None:
        for conn in self.sessions:
            conn.close()


def no_arguments(parser: argparse.ArgumentParser) -> None:
    """For a question that has no options of its own."""
