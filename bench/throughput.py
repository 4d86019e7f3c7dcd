"""Section 2: how many locked no-op Celery calls per second, and what CPU does each cost?

Real ``celery worker`` processes (2 each, one worker per strategy) run a plain
task, ``TenantLockedTask`` under each strategy and a Redis-lease base task, in
interleaved rounds whose order rotates (after a warm-up round); the CPU each
call takes from its worker's processes and from the whole Postgres server is
read around each run.

    python -m bench.throughput [--tasks 1000]

rewrites ``bench/results/throughput.json`` and renders BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
import uuid
from typing import Any

import psutil

from bench import cli
from bench.common import Context, server_pid, strategies
from bench.workers import worker

NAME, SECTION, TITLE = "throughput", "2", "Celery throughput"

#: key -> (label, task, the strategy of the worker that runs it).
VARIANTS = {
    "plain": ("plain Celery task", "plain", "reuse"),
    "reuse": ("TenantLockedTask, reuse (default)", "locked", "reuse"),
    "shared": ("TenantLockedTask, shared", "locked", "shared"),
    "connect": ("TenantLockedTask, connect", "locked", "connect"),
    "lease": ("Redis-lease base task", "leased", "reuse"),
}
ROUNDS = 5
WORKER_PROCESSES = 2


def rate(task_name: str, count: int, queue: str) -> float:
    """Tasks per second of ``count`` calls sent at once and waited for."""
    from bench.app import app

    task = app.tasks[f"bench.app.{task_name}"]
    start = time.perf_counter()
    calls = [task.apply_async((i,), queue=queue) for i in range(count)]
    for call in calls:
        call.get(timeout=120)
    return count / (time.perf_counter() - start)


def cpu_seconds(pid: int | None) -> float:
    """CPU time of a process and its live children so far; 0 for one not seen here."""
    if pid is None:
        return 0.0
    try:
        root = psutil.Process(pid)
        total = 0.0
        for process in [root, *root.children(recursive=True)]:
            with contextlib.suppress(psutil.Error):
                times = process.cpu_times()
                total += times.user + times.system
        return total
    except psutil.Error:
        return 0.0


def worker_pid(queue: str) -> int | None:
    """The main process of the benchmark's worker on ``queue``."""
    for process in psutil.process_iter(["cmdline"]):
        cmdline = process.info["cmdline"] or []
        if "worker" in cmdline and queue in cmdline:
            return int(process.pid)
    return None


def rounds_of(dsn: str, count: int, queues: dict[str, str]) -> dict[str, Any]:
    """Each variant's rate in each of the interleaved rounds (after a warm-up round), and
    the CPU each task took from its worker's processes and from the Postgres server."""
    chosen = {key: v for key, v in VARIANTS.items() if v[2] in queues}
    keys = list(chosen)
    workers = {strategy: worker_pid(queue) for strategy, queue in queues.items()}
    server = server_pid(dsn)
    worker_ms: dict[str, list[float]] = {key: [] for key in keys}
    server_ms: dict[str, list[float]] = {key: [] for key in keys}
    rounds: list[dict[str, float]] = []
    for round_number in range(ROUNDS + 1):
        # The order rotates: no variant always runs right after the same other one.
        shift = round_number % len(keys)
        rates: dict[str, float] = {}
        for key in keys[shift:] + keys[:shift]:
            _, task, strategy = chosen[key]
            calls = count if round_number else 50
            worker_before, server_before = cpu_seconds(workers[strategy]), cpu_seconds(server)
            rates[key] = rate(task, calls, queues[strategy])
            if round_number:
                spent = (cpu_seconds(workers[strategy]) - worker_before) * 1000 / calls
                worker_ms[key].append(spent)
                server_ms[key].append((cpu_seconds(server) - server_before) * 1000 / calls)
        if round_number:
            rounds.append({key: rates[key] for key in keys})
    return {
        "variants": [{"key": key, "label": chosen[key][0]} for key in keys],
        "rounds": rounds,
        "worker_cpu_ms": worker_ms,
        # None when the server is not on this machine (its CPU cannot be read).
        "server_cpu_ms": server_ms if server is not None else None,
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tasks", type=int, default=1000, help="tasks per throughput run")


def measure(ctx: Context, args: argparse.Namespace) -> dict[str, Any]:
    env = {"PGLOCK_DSN": ctx.dsn, "PGLOCK_BENCH_BROKER": ctx.broker}
    queues = {s: f"pglock-bench-{s}-{uuid.uuid4().hex[:6]}" for s in strategies(ctx.dsn)}
    per_round = args.tasks // 5
    with contextlib.ExitStack() as workers:
        for strategy, queue in queues.items():
            workers.enter_context(
                worker(
                    {**env, "PGLOCK_STRATEGY": strategy, "PGLOCK_BENCH_QUEUE": queue},
                    ctx.work,
                    concurrency=WORKER_PROCESSES,
                )
            )
        data = rounds_of(ctx.dsn, per_round, queues)
    for variant in data["variants"]:
        median = statistics.median(r[variant["key"]] for r in data["rounds"])
        print(f"  {variant['label']}: {median:.0f} tasks/s", flush=True)
    return {"tasks_per_round": per_round, "worker_processes": WORKER_PROCESSES, **data}


if __name__ == "__main__":
    sys.exit(cli.main([sys.modules[__name__]], "python -m bench.throughput", TITLE))
