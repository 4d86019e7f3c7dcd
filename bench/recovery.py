"""Section 3: how soon is a lock free again after its holder is SIGKILLed?

A holder process takes an advisory lock (or a Redis lease with a 30 s TTL) and is
killed; the time until another client gets the lock is measured (10 rounds for
the advisory lock, one for the lease, whose TTL runs out meanwhile).

    python -m bench.recovery

rewrites ``bench/results/recovery.json`` and renders BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import subprocess
import sys
import time
import uuid
from typing import Any

import redis

from bench import cli
from bench.common import ROOT, Context, close_sessions, no_arguments
from pglock_celery.config import PglockConfig
from pglock_celery.lock import AdvisoryLock

NAME, SECTION, TITLE = "recovery", "3", "recovery after SIGKILL"
ROUNDS = 10

HOLDER = """
import sys, time
from pglock_celery import try_lock
with try_lock(sys.argv[2], dsn=sys.argv[1]) as lock:
    assert lock.acquired
    print("held", flush=True)
    time.sleep(120)
"""

LEASE_HOLDER = """
import sys, time, redis
client = redis.Redis.from_url(sys.argv[1])
assert client.set(sys.argv[2], "holder", nx=True, px=30_000)
print("held", flush=True)
time.sleep(120)
"""


def recovery_advisory(dsn: str, rounds: int) -> list[float]:
    times = []
    for n in range(rounds):
        name = f"bench:recovery:{uuid.uuid4().hex[:6]}:{n}"
        holder = subprocess.Popen([sys.executable, "-c", HOLDER, dsn, name], cwd=ROOT,
                                  env={**os.environ, "PYTHONPATH": str(ROOT)},
                                  stdout=subprocess.PIPE, text=True)  # fmt: skip
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        config = PglockConfig(dsn=dsn, strategy="reuse")
        holder.kill()
        killed = time.perf_counter()
        while True:
            with AdvisoryLock(name, config=config) as lock:
                if lock.acquired:
                    break
        times.append(time.perf_counter() - killed)
        holder.wait()
        holder.stdout.close()
    close_sessions()
    return times


def recovery_lease(broker: str) -> float:
    key = f"bench:recovery:{uuid.uuid4().hex[:6]}"
    holder = subprocess.Popen([sys.executable, "-c", LEASE_HOLDER, broker, key],
                              stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
    holder.kill()
    killed = time.perf_counter()
    client = redis.Redis.from_url(broker)
    while not client.set(key, "next", nx=True, px=30_000):
        time.sleep(0.01)  # polling the lease, as a waiting replica would
    holder.wait()
    holder.stdout.close()
    client.delete(key)
    return time.perf_counter() - killed


add_arguments = no_arguments


def measure(ctx: Context, args: argparse.Namespace) -> dict[str, Any]:
    # The lease's 30 s run out meanwhile: its poll costs next to nothing.
    with concurrent.futures.ThreadPoolExecutor(1) as lease:
        expired = lease.submit(recovery_lease, ctx.broker)
        advisory = recovery_advisory(ctx.dsn, ROUNDS)
        lease_seconds = expired.result()
    return {"advisory_seconds": advisory, "lease_ttl_seconds": 30, "lease_seconds": lease_seconds}


if __name__ == "__main__":
    sys.exit(cli.main([sys.modules[__name__]], "python -m bench.recovery", TITLE))
