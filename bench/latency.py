"""Section 1: what does a lock cycle (acquire + release) cost, against the alternatives?

Every method runs the same uncontended cycle, in interleaved rounds (each round
opens every method's connections afresh and runs every method one after the
other), alone and then with 8 client processes at once: two ``SELECT 1`` (the
floor: two round trips), the library under each strategy, the hand-rolled pair of
statements on an open session, a Redis lease, python-redis-lock and a TTL row.

    python -m bench.latency [--count 2000] [--clients 8]

rewrites ``bench/results/latency.json`` and renders BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import psycopg
import redis

from bench import cli
from bench.common import (
    Context,
    close_sessions,
    server_cpu_ns,
    server_pid,
    shared_config,
    strategies,
)
from pglock_celery.config import PglockConfig
from pglock_celery.lock import AdvisoryLock

NAME, SECTION, TITLE = "latency", "1", "acquire + release latency"

_UNLOCK = (
    "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end return 0"
)

# Each method is a factory: (dsn, broker) -> (one cycle given an index, clean-up).
# Methods are measured in interleaved rounds, so that the noise of a shared
# machine falls on all of them alike.

Cycle = Callable[[int], object]
Method = Callable[[str, str], tuple[Cycle, Callable[[], None]]]

#: key -> label; the keys are what the renderer and the targets look methods up by.
LABELS = {
    "floor": "SELECT 1 twice (floor: two round trips)",
    "reuse": "advisory, pglock reuse (default)",
    "shared": "advisory, pglock shared",
    "connect": "advisory, pglock connect",
    "hand": "advisory, hand-rolled on an open session",
    "lease": "Redis lease (SET NX PX + token delete)",
    "redis_lock": "python-redis-lock",
    "ttl": "Postgres table with TTL (rejected design)",
}


def _floor(dsn: str, broker: str) -> tuple[Cycle, Callable[[], None]]:
    """Two round trips that do nothing: what a lock plus a release cost at the least."""
    conn = psycopg.connect(dsn, autocommit=True)

    def once(i: int) -> None:
        conn.execute("SELECT 1").fetchone()
        conn.execute("SELECT 1").fetchone()

    return once, conn.close


def _advisory(strategy: str) -> Method:
    def make(dsn: str, broker: str) -> tuple[Cycle, Callable[[], None]]:
        config = shared_config(dsn) if strategy == "shared" else None
        config = config or PglockConfig(dsn=dsn, strategy=strategy)
        tag = uuid.uuid4().hex[:6]

        def once(i: int) -> None:
            with AdvisoryLock(f"bench:{tag}:{i}", config=config) as lock:
                assert lock.acquired

        return once, close_sessions

    return make


def _raw_session(dsn: str, broker: str) -> tuple[Cycle, Callable[[], None]]:
    conn = psycopg.connect(dsn, autocommit=True)

    def once(i: int) -> None:
        conn.execute("SELECT pg_try_advisory_lock(%s)", (i,)).fetchone()
        conn.execute("SELECT pg_advisory_unlock(%s)", (i,)).fetchone()

    return once, conn.close


def _redis_lease(dsn: str, broker: str) -> tuple[Cycle, Callable[[], None]]:
    client = redis.Redis.from_url(broker)
    unlock = client.register_script(_UNLOCK)
    tag = uuid.uuid4().hex[:6]

    def once(i: int) -> None:
        key, token = f"bench:{tag}:{i}", uuid.uuid4().hex
        assert client.set(key, token, nx=True, px=30_000)
        unlock(keys=[key], args=[token])

    return once, client.close


def _python_redis_lock(dsn: str, broker: str) -> tuple[Cycle, Callable[[], None]]:
    import redis_lock

    client = redis.Redis.from_url(broker)
    tag = uuid.uuid4().hex[:6]

    def once(i: int) -> None:
        lock = redis_lock.Lock(client, f"bench:{tag}:{i}", expire=30)
        assert lock.acquire(blocking=False)
        lock.release()

    return once, client.close


def _ttl_table(dsn: str, broker: str) -> tuple[Cycle, Callable[[], None]]:
    conn = psycopg.connect(dsn, autocommit=True)
    tag = uuid.uuid4().hex[:6]

    def once(i: int) -> None:
        name, holder = f"bench:{tag}:{i}", uuid.uuid4().hex
        row = conn.execute(
            "INSERT INTO pglock_bench_lease (name, holder, expires)"
            " VALUES (%s, %s, now() + interval '30 seconds')"
            " ON CONFLICT (name) DO UPDATE SET holder = EXCLUDED.holder,"
            " expires = EXCLUDED.expires WHERE pglock_bench_lease.expires < now()"
            " RETURNING holder",
            (name, holder),
        ).fetchone()
        assert row is not None
        conn.execute(
            "DELETE FROM pglock_bench_lease WHERE name = %s AND holder = %s", (name, holder)
        )

    return once, conn.close


def methods(dsn: str) -> dict[str, Method]:
    """Every method, by key; ``shared`` only on a build that has it."""
    found: dict[str, Method] = {
        "floor": _floor,
        "reuse": _advisory("reuse"),
        "shared": _advisory("shared"),
        "connect": _advisory("connect"),
        "hand": _raw_session,
        "lease": _redis_lease,
        "redis_lock": _python_redis_lock,
        "ttl": _ttl_table,
    }
    if "shared" not in strategies(dsn):
        del found["shared"]
    return found


ROUNDS = 20


@dataclass
class Cycles:
    """Seconds per cycle of each method; with ``server``, the CPU each cycle took."""

    samples: dict[str, list[float]]
    #: Per method, CPU seconds of this process and of the server over the timed cycles.
    client_cpu: dict[str, float] = field(default_factory=dict)
    server_cpu: dict[str, float] = field(default_factory=dict)


def measure_cycles(dsn: str, broker: str, count: int, server: int | None = None) -> Cycles:
    """``count`` cycles of every method, in interleaved rounds; seconds per cycle.

    Each round opens every method's connections afresh, and its first cycles are
    not counted: on a small machine the latency of a connection depends on which
    core its server process lands on, and new connections each round spread that
    luck over all methods alike. With ``server`` (the Postgres server's pid), the
    CPU this process and the server spent on the timed cycles is added up, read
    around each method's cycles of a round (outside the per-cycle timings).
    """
    chosen = methods(dsn)
    found = Cycles({key: [] for key in chosen})
    per_round = max(1, count // ROUNDS)
    for round_number in range(ROUNDS):
        for key, factory in chosen.items():
            once, close = factory(dsn, broker)
            samples = found.samples[key]
            try:
                for i in range(5):  # connect, fill caches, prepare plans: not counted
                    once(-i - 1)
                if server is not None:
                    # The server's first: reading it costs this process CPU.
                    server_before = server_cpu_ns(server)
                    client_before = time.process_time()
                for i in range(per_round):
                    index = round_number * per_round + i
                    began = time.perf_counter()
                    once(index)
                    samples.append(time.perf_counter() - began)
                if server is not None:
                    client = time.process_time() - client_before
                    found.client_cpu[key] = found.client_cpu.get(key, 0.0) + client
                    spent = (server_cpu_ns(server) - server_before) / 1e9
                    found.server_cpu[key] = found.server_cpu.get(key, 0.0) + spent
            finally:
                close()
    return found


def _client(args: tuple[str, str, int]) -> dict[str, list[float]]:
    return measure_cycles(*args).samples


def p50_ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1000


def p99_ms(samples: list[float]) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] * 1000


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--count", type=int, default=2000, help="lock cycles per method")
    parser.add_argument("--clients", type=int, default=8, help="concurrent clients")


def measure(ctx: Context, args: argparse.Namespace) -> dict[str, Any]:
    dsn, broker, count, clients = ctx.dsn, ctx.broker, args.count, args.clients
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "CREATE TABLE IF NOT EXISTS pglock_bench_lease"
            " (name text PRIMARY KEY, holder text NOT NULL, expires timestamptz NOT NULL)"
        )
    try:
        cycles = measure_cycles(dsn, broker, count, server_pid(dsn))
        single = cycles.samples
        with multiprocessing.get_context("spawn").Pool(clients) as pool:
            many = pool.map(_client, [(dsn, broker, count // 4)] * clients)
    finally:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("DROP TABLE pglock_bench_lease")
    per_round = max(1, count // ROUNDS)
    rows = []
    for key in single:
        together = [s for client in many for s in client[key]]
        row = {
            "key": key,
            "label": LABELS[key],
            "p50_ms": p50_ms(single[key]),
            "p99_ms": p99_ms(single[key]),
            "p50_ms_clients": p50_ms(together),
            "p99_ms_clients": p99_ms(together),
        }
        if key in cycles.client_cpu:
            timed_cycles = len(single[key])
            row["client_cpu_us"] = cycles.client_cpu[key] * 1e6 / timed_cycles
            row["server_cpu_us"] = cycles.server_cpu[key] * 1e6 / timed_cycles
        rows.append(row)
        print(
            f"  {LABELS[key]}: p50 {row['p50_ms']:.3f} ms;"
            f" {clients} clients {row['p50_ms_clients']:.3f} ms",
            flush=True,
        )
    return {
        "count": count,
        "clients": clients,
        "per_client": count // 4,
        "rounds": ROUNDS,
        "methods": rows,
        # Each method's p50 in each round of the single client (the rounds interleave).
        "round_p50_ms": {
            key: [p50_ms(samples[n * per_round : (n + 1) * per_round]) for n in range(ROUNDS)]
            for key, samples in single.items()
        },
    }


if __name__ == "__main__":
    sys.exit(cli.main([sys.modules[__name__]], "python -m bench.latency", TITLE))
