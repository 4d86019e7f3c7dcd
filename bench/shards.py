"""Section 8: what do shards cost, and what do they buy? On three Postgres servers of its own.

``pglock_shards`` routes each lock name to one of several databases (rendezvous
hashing, shards.py). Three throwaway servers (bench/server.py's way, each its own
data directory, port and processes; stopped, and their postmasters checked gone by
pid, at the end) are the shards:

- Routing: what the lock path does to find a name's shard (``previous_for_key`` then
  ``for_key`` on the app's configuration), for a name placed before (cached) and a
  name never seen (the rendezvous hash), and the public ``shard_of(name)``; against a
  lock cycle (``try_lock`` acquire + release) on one shard, in interleaved rounds.
- Held locks: ``HOLD`` locks held at once over the three servers by one process under
  the ``shared`` strategy (``pglock_strategy``), on at most ``HOLD_SESSIONS`` sessions
  per shard, with each server's ``max_locks_per_transaction`` raised to what the
  routed names need. Within ``HOLD_DEADLINE``, else what was held and an
  extrapolation. Memory: the holder process's RssAnon, each server's lock sessions'
  backends (/proc), the servers' shared memory for the lock table.
- Throughput: lock cycles per second with 1, 2 and 3 shards, ``SPIN_PROCESSES``
  client processes each time, and the CPU per cycle in the clients and the servers.

The capacity model of the page is computed by bench.report from these figures.
Runs alone in about 3 to 4 minutes, rewrites ``bench/results/shards.json`` and
renders BENCHMARKS.md::

    python -m bench.shards
"""

from __future__ import annotations

import argparse
import contextlib
import math
import multiprocessing
import os
import random
import signal
import statistics
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import psycopg
from celery import Celery

from bench import cli
from bench.common import Context, close_sessions, no_arguments
from bench.scale import backend_memory
from bench.server import system_bindir
from pglock_celery.config import PglockConfig, get_config
from pglock_celery.keys import lock_key
from pglock_celery.lock import AdvisoryLock, shard_of, try_lock
from pglock_celery.shards import parse_shards, rendezvous
from tasks.services import EmbeddedPostgres, wait_until

NAME, SECTION, TITLE = "shards", "8", "shards"

SHARDS = ("shard-1", "shard-2", "shard-3")
#: Each shard server's max_connections: the clients here need a few dozen at most.
MAX_CONNECTIONS = 100
#: Postgres's default max_locks_per_transaction (the lock table's size per backend).
DEFAULT_LOCKS_PER_TRANSACTION = 64
#: Head room over the lock-table slots the routed names need.
LOCK_TABLE_MARGIN = 1.1

ROUTE_ROUNDS = 5
#: Routing calls per timed batch (one call is well under a microsecond to a few).
ROUTE_BATCH = 20_000
#: Names placed before, cycled through by the cached-routing batches.
ROUTE_NAMES = 1_000
CYCLES_PER_ROUND = 300

HOLD = 100_000
#: Shared sessions per shard for the held locks. Each statement on a session costs the
#: server more the more locks that session holds (measured: see ``server_fit``), so
#: with the default 4 the fill of 100,000 would be quadratic past this section's time.
HOLD_SESSIONS = 16
#: Threads of the holder process taking the locks (its sessions' servers then work
#: at once).
HOLD_THREADS = 3
#: Seconds the fill may take; past them, what was held is measured and extrapolated.
HOLD_DEADLINE = 150.0
#: pglock_check_interval of the holder: loss checks would otherwise run throughout
#: the fill, one statement per hold every 2 s (50,000 a second at 100,000 holds).
HOLD_CHECK_INTERVAL = 3600.0
#: held() checks timed on random held locks once all are held: one loss check each.
CHECK_SAMPLE = 2_000
#: Seconds between two progress reports of the holder.
PROGRESS = 5.0
#: Fewest locks a progress report must add to count as a block of the fits.
MIN_BLOCK = 1_000

SPIN_PROCESSES = 4
SPIN_SECONDS = 2.0
SPIN_ROUNDS = 3
#: Cycles each client runs before a window (every shard's session open by then).
SPIN_WARMUP = 30
#: Seconds a client keeps its sessions after a window, so that their backends' CPU
#: is read before they end.
SPIN_LINGER = 0.5


# --- the shard servers ----------------------------------------------------------------------


@dataclass
class ShardServer:
    name: str
    server: EmbeddedPostgres
    #: The postmaster's pid (postmaster.pid), checked gone at the end.
    pid: int
    #: MB of shared memory that LOCK_TABLE_STEP more max_locks_per_transaction cost.
    step_mb: int

    @property
    def dsn(self) -> str:
        return self.server.dsn


#: How much larger a lock table is asked of Postgres for its shared memory per slot.
LOCK_TABLE_STEP = 4000


def shared_memory_mb(server: EmbeddedPostgres, locks_per_transaction: int) -> int:
    """The shared memory in MB with that lock table, as Postgres computes it (stopped)."""
    done = server._run(
        str(server.bindir / "postgres"), "-D", str(server.data), "-C", "shared_memory_size",
        "-c", f"max_locks_per_transaction={locks_per_transaction}",
    )  # fmt: skip
    return int(done.stdout.strip())


@contextlib.contextmanager
def shard_servers(base: Path, locks_per_transaction: int) -> Iterator[list[ShardServer]]:
    """Three servers of their own; stopped at the end, each postmaster killed if it stays."""
    started: list[ShardServer] = []
    try:
        for name in SHARDS:
            server = EmbeddedPostgres(base / name)
            server.bindir = system_bindir() or server.bindir
            server.init(
                f"max_connections = {MAX_CONNECTIONS}",
                f"max_locks_per_transaction = {locks_per_transaction}",
            )
            low = DEFAULT_LOCKS_PER_TRANSACTION
            step = shared_memory_mb(server, low + LOCK_TABLE_STEP) - shared_memory_mb(server, low)
            server.start()
            pid = int((server.data / "postmaster.pid").read_text().split()[0])
            started.append(ShardServer(name, server, pid, step))
        yield started
    finally:
        for shard in started:
            shard.server.destroy()
            with contextlib.suppress(ProcessLookupError):
                os.kill(shard.pid, 0)  # still there after pg_ctl stop: ours, by its pid
                os.kill(shard.pid, signal.SIGKILL)


def lock_table(servers: list[ShardServer], locks_per_transaction: int) -> dict[str, Any]:
    """The lock table's settings and its shared memory per slot."""
    with psycopg.connect(servers[0].dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT current_setting('max_prepared_transactions')::int,"
            " current_setting('autovacuum_max_workers')::int"
            " + current_setting('max_worker_processes')::int"
            " + current_setting('max_wal_senders')::int + 1,"
            " current_setting('shared_memory_size')"
        ).fetchone()
    assert row is not None
    prepared, auxiliary, size = row
    # Postgres sizes the table for every backend, not only the connections:
    # (max_connections + autovacuum, bgworkers, WAL senders, the launcher + prepared).
    backends = MAX_CONNECTIONS + auxiliary + prepared
    return {
        "max_connections": MAX_CONNECTIONS,
        "max_prepared_transactions": prepared,
        "auxiliary_backends": auxiliary,
        "default_locks_per_transaction": DEFAULT_LOCKS_PER_TRANSACTION,
        "locks_per_transaction": locks_per_transaction,
        # The documented size: max_locks_per_transaction x (max_connections + prepared).
        "slots": locks_per_transaction * (MAX_CONNECTIONS + prepared),
        "allocated_slots": locks_per_transaction * backends,
        "shared_memory": size,
        "bytes_per_slot": servers[0].step_mb * 1024 * 1024 / (LOCK_TABLE_STEP * backends),
    }


def locks_needed(per_shard: dict[str, int]) -> tuple[int, int]:
    """(max_locks_per_transaction the busiest shard needs, the value set with head room)."""
    most = max(per_shard.values())
    needed = math.ceil(most / MAX_CONNECTIONS)  # max_prepared_transactions is 0 here
    return needed, max(DEFAULT_LOCKS_PER_TRANSACTION, math.ceil(needed * LOCK_TABLE_MARGIN))


def hold_name(n: int) -> str:
    return f"bench-shards:hold:{n}"


# --- routing --------------------------------------------------------------------------------


@contextlib.contextmanager
def current(app: Celery) -> Iterator[None]:
    """``app`` as the current app (what try_lock reads), the previous one back after."""
    from celery import _state

    previous = _state.get_current_app()
    app.set_current()
    try:
        yield
    finally:
        previous.set_current()


def _app(name: str, **conf: Any) -> Celery:
    app = Celery(f"pglock_bench_{name}", set_as_current=False)
    app.conf.update(**conf)
    return app


def _per_call(batch: Callable[[int], None], count: int) -> float:
    """Seconds per call of a batch of ``count``, less the bare loop's."""
    began = time.perf_counter()
    batch(count)
    spent = time.perf_counter() - began
    began = time.perf_counter()
    for _ in range(count):
        pass
    return max(0.0, spent - (time.perf_counter() - began)) / count


def measure_routing(servers: list[ShardServer]) -> dict[str, Any]:
    """Routing per call (cached, first placement, shard_of) against a lock cycle, rotated."""
    dsns = {shard.name: shard.dsn for shard in servers}
    sharded = _app("shards", pglock_shards=dsns)
    one = _app("one_shard", pglock_dsn=servers[0].dsn)
    config = get_config(sharded)
    tag = uuid.uuid4().hex[:8]
    # Names of shard 1 alone, found without touching the configuration's cache.
    candidates = (f"bench-shards:cycle:{tag}:{n}" for n in range(10**9))
    cycle_names = (name for name in candidates if rendezvous(lock_key(name), SHARDS) == SHARDS[0])
    plain = iter(f"bench-shards:one:{tag}:{n}" for n in range(10**9))
    placed = [
        (lock_key(name), name)
        for name in (f"bench-shards:placed:{tag}:{n}" for n in range(ROUTE_NAMES))
    ]
    for key, name in placed:
        config.for_key(key, name)
    fresh = [
        (lock_key(name), name)
        for name in (f"bench-shards:fresh:{tag}:{n}" for n in range(ROUTE_BATCH * ROUTE_ROUNDS))
    ]
    used = [0]

    def cached(count: int) -> None:
        for i in range(count):
            key, name = placed[i % ROUTE_NAMES]
            config.previous_for_key(key, name)
            config.for_key(key, name)

    def first_placement(count: int) -> None:
        begin = used[0]
        used[0] += count
        for key, name in fresh[begin : begin + count]:
            config.previous_for_key(key, name)
            config.for_key(key, name)

    def public(count: int) -> None:
        with current(sharded):
            for i in range(count):
                shard_of(placed[i % ROUTE_NAMES][1])

    def cycles(app: Celery, source: Iterator[str]) -> list[float]:
        samples = []
        with current(app):
            for _ in range(CYCLES_PER_ROUND):
                name = next(source)
                began = time.perf_counter()
                with try_lock(name) as lock:
                    assert lock.acquired
                samples.append(time.perf_counter() - began)
        return samples

    steps: dict[str, Callable[[], list[float]]] = {
        "cycle": lambda: cycles(sharded, cycle_names),
        "cycle_one_dsn": lambda: cycles(one, plain),
        "cached": lambda: [_per_call(cached, ROUTE_BATCH)],
        "first_placement": lambda: [_per_call(first_placement, ROUTE_BATCH)],
        "shard_of": lambda: [_per_call(public, ROUTE_BATCH)],
    }
    order = list(steps)
    samples: dict[str, list[float]] = {what: [] for what in order}
    try:
        cycles(sharded, cycle_names)  # sessions open, statements prepared: not counted
        cycles(one, plain)
        public(ROUTE_NAMES)
        for round_number in range(ROUTE_ROUNDS):
            shift = round_number % len(order)
            for what in order[shift:] + order[:shift]:
                samples[what].extend(steps[what]())
    finally:
        close_sessions()
    return {
        "shards": len(SHARDS),
        "rounds": ROUTE_ROUNDS,
        "batch": ROUTE_BATCH,
        "cycles": CYCLES_PER_ROUND * ROUTE_ROUNDS,
        # Seconds: the p50 of the cycles, the median of the rounds' per-call routing.
        "cycle_p50": statistics.median(samples["cycle"]),
        "cycle_one_dsn_p50": statistics.median(samples["cycle_one_dsn"]),
        "cached": statistics.median(samples["cached"]),
        "first_placement": statistics.median(samples["first_placement"]),
        "shard_of": statistics.median(samples["shard_of"]),
    }


# --- held locks -----------------------------------------------------------------------------


def _rss_anon_kb() -> int:
    status = Path("/proc/self/status").read_text()
    line = next(line for line in status.splitlines() if line.startswith("RssAnon:"))
    return int(line.split()[1])


def _holder(dsns: dict[str, str], prefix: str, pipe: Connection) -> None:
    """The holder process: take HOLD locks on the shards' shared sessions, report, wait.

    Sends ("ready", RssAnon), ("progress", held, seconds, CPU seconds) every PROGRESS
    s, then ("held", held, seconds, RssAnon, check seconds, errors); keeps the locks
    until it is killed (its sessions end with it, and the servers free their locks).
    """
    config = PglockConfig(
        shards=parse_shards(dsns),
        strategy="shared",
        shared_sessions=HOLD_SESSIONS,
        check_interval=HOLD_CHECK_INTERVAL,
        application_name=prefix,
    )
    locks: list[AdvisoryLock] = []
    counts = [0] * HOLD_THREADS
    errors: dict[str, int] = {}
    pipe.send(("ready", _rss_anon_kb()))
    began, cpu = time.perf_counter(), time.process_time()
    deadline = began + HOLD_DEADLINE

    def fill(thread: int) -> None:
        for n in range(thread, HOLD, HOLD_THREADS):
            if time.perf_counter() > deadline:
                return
            try:
                lock = AdvisoryLock(hold_name(n), config=config)
                if not lock.acquire():
                    raise RuntimeError("the lock was not free")
            except Exception as exc:
                errors[repr(exc)] = errors.get(repr(exc), 0) + 1
                continue
            locks.append(lock)
            counts[thread] += 1

    threads = [threading.Thread(target=fill, args=(n,)) for n in range(HOLD_THREADS)]
    for thread in threads:
        thread.start()
    while any(thread.is_alive() for thread in threads):
        for thread in threads:
            thread.join(PROGRESS / HOLD_THREADS)
        elapsed = time.perf_counter() - began
        pipe.send(("progress", sum(counts), elapsed, time.process_time() - cpu))
    seconds = time.perf_counter() - began
    rss = _rss_anon_kb()
    checks = []
    for lock in random.sample(locks, min(CHECK_SAMPLE, len(locks))):
        started = time.perf_counter()
        assert lock.held()
        checks.append(time.perf_counter() - started)
    pipe.send(("held", len(locks), seconds, rss, statistics.median(checks), errors))
    pipe.recv()  # never comes: the parent kills this process


def _backend_cpu(servers: list[ShardServer]) -> dict[int, int]:
    """CPU nanoseconds so far of each process of the servers, by pid."""
    import psutil

    found: dict[int, int] = {}
    for shard in servers:
        with contextlib.suppress(psutil.Error):
            for pid in [shard.pid, *(c.pid for c in psutil.Process(shard.pid).children())]:
                with contextlib.suppress(OSError, ValueError, IndexError):
                    found[pid] = int(Path(f"/proc/{pid}/schedstat").read_text().split()[0])
    return found


def _cpu_since(before: dict[int, int], servers: list[ShardServer]) -> int:
    """Server CPU nanoseconds since ``before``, over the processes alive now (one that
    ended meanwhile takes its time with it: a sum over all would run backwards)."""
    return sum(ns - before.get(pid, 0) for pid, ns in _backend_cpu(servers).items())


_SESSIONS = "SELECT pid FROM pg_stat_activity WHERE application_name LIKE %s"
_ADVISORY = "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'"


def _count(dsn: str, query: str, *args: Any) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(query, args or None).fetchone()
    return int(row[0]) if row else 0


def measure_held(servers: list[ShardServer], per_shard: dict[str, int]) -> dict[str, Any]:
    """HOLD locks held at once by one process over the shards, and what it costs."""
    prefix = f"pgb{uuid.uuid4().hex[:8]}"
    dsns = {shard.name: shard.dsn for shard in servers}
    spawn = multiprocessing.get_context("spawn")
    parent, child = spawn.Pipe()
    holder = spawn.Process(target=_holder, args=(dsns, prefix, child), daemon=True)
    holder.start()
    blocks: list[dict[str, float]] = []
    idle_kb = _idle_backend_kb(servers[0].dsn)
    try:
        kind, before = parent.recv()
        assert kind == "ready", kind
        last = {"held": 0.0, "seconds": 0.0, "cpu": 0.0}
        since = _backend_cpu(servers)
        while True:
            if not parent.poll(HOLD_DEADLINE + 120):
                raise RuntimeError("the holder process stopped reporting")
            message = parent.recv()
            if message[0] == "held":
                break
            _, held, seconds, cpu = message
            took = held - last["held"]
            if took >= MIN_BLOCK:
                server = _cpu_since(since, servers)
                blocks.append(
                    {
                        "held": held,
                        "seconds": seconds,
                        # Locks each shared session held on average during the block.
                        "per_session": (held + last["held"]) / 2 / (len(SHARDS) * HOLD_SESSIONS),
                        "wall_us": (seconds - last["seconds"]) / took * 1e6,
                        "client_us": (cpu - last["cpu"]) / took * 1e6,
                        "server_us": server / took / 1e3,
                    }
                )
                last, since = {"held": held, "seconds": seconds, "cpu": cpu}, _backend_cpu(servers)
        _, held, seconds, after, check, errors = message
        shards = []
        for shard in servers:
            with psycopg.connect(shard.dsn, autocommit=True) as conn:
                pids = [row[0] for row in conn.execute(_SESSIONS, (prefix + "%",))]
                locks = _count(shard.dsn, _ADVISORY)
            memory = backend_memory(pids)
            shards.append(
                {
                    "name": shard.name,
                    "routed": per_shard[shard.name],
                    "sessions": len(pids),
                    "locks": locks,
                    "private_kb": memory[0] if memory else None,
                    "rss_kb": memory[1] if memory else None,
                }
            )
    finally:
        holder.kill()  # a process of our own, by its pid: its sessions end, its locks go
        holder.join()
    died = time.perf_counter()
    for shard in servers:
        wait_until(_no_advisory_lock(shard.dsn), 60, f"the locks on {shard.name} to go", 0.01)
    return {
        "target": HOLD,
        "held": held,
        "seconds": seconds,
        "deadline": HOLD_DEADLINE,
        "threads": HOLD_THREADS,
        "sessions_per_shard": HOLD_SESSIONS,
        "check_interval": HOLD_CHECK_INTERVAL,
        "default_check_interval": PglockConfig().check_interval,
        "default_shared_sessions": PglockConfig().shared_sessions,
        "idle_backend_kb": idle_kb,
        "rss_before_kb": before,
        "rss_after_kb": after,
        "check_seconds": check,
        "check_sample": CHECK_SAMPLE,
        "freed_seconds": time.perf_counter() - died,
        "errors": errors,
        "shards": shards,
        "blocks": blocks,
        "server_fit": _fit([(b["per_session"], b["server_us"]) for b in blocks]),
        "wall_fit": _fit([(b["held"], b["wall_us"]) for b in blocks]),
    }


def _idle_backend_kb(dsn: str) -> int | None:
    """A fresh backend's private memory (RssAnon) once it has run a statement."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SELECT count(*) FROM pg_locks")
        memory = backend_memory([conn.info.backend_pid])
    return memory[0] if memory else None


def _no_advisory_lock(dsn: str) -> Callable[[], bool]:
    return lambda: _count(dsn, _ADVISORY) == 0


def _fit(points: list[tuple[float, float]]) -> dict[str, float] | None:
    """Least squares ``y = base + slope * x`` over the points; None with fewer than 3."""
    if len(points) < 3:
        return None
    slope, base = statistics.linear_regression([x for x, _ in points], [y for _, y in points])
    return {"base": base, "slope": slope}


# --- throughput -----------------------------------------------------------------------------


def _spin(args: tuple[dict[str, str], float, float]) -> tuple[int, float, float]:
    """One client process: lock cycles (``reuse``) from ``start`` to ``end``.

    Returns (cycles, CPU seconds, seconds it began late: its warm-up outlasted the lead).
    """
    dsns, start, end = args
    config = PglockConfig(shards=parse_shards(dsns))
    tag = uuid.uuid4().hex[:8]
    count = iter(range(10**9))

    def once() -> None:
        with AdvisoryLock(f"bench-shards:spin:{tag}:{next(count)}", config=config) as lock:
            assert lock.acquired

    try:
        for _ in range(SPIN_WARMUP):
            once()
        late = max(0.0, time.time() - start)
        time.sleep(max(0.0, start - time.time()))
        cpu, cycles = time.process_time(), 0
        while time.time() < end:
            once()
            cycles += 1
        spent = time.process_time() - cpu
        # Its sessions stay until the servers' CPU is read, just after the window.
        time.sleep(max(0.0, end + SPIN_LINGER - time.time()))
        return cycles, spent, late
    finally:
        close_sessions()


def measure_throughput(servers: list[ShardServer]) -> dict[str, Any]:
    """Cycles per second with 1, 2 and 3 shards, the same clients, in rotating rounds."""
    counts = list(range(1, len(servers) + 1))
    found: dict[int, list[tuple[float, float, float]]] = {n: [] for n in counts}
    late = 0.0
    spawn = multiprocessing.get_context("spawn")
    with spawn.Pool(SPIN_PROCESSES) as pool:
        # Every client imported and connected once before the first window: not counted.
        now = time.time()
        every = {shard.name: shard.dsn for shard in servers}
        pool.map(_spin, [(every, now, now)] * SPIN_PROCESSES, 1)
        for round_number in range(SPIN_ROUNDS):
            shift = round_number % len(counts)
            for shards in counts[shift:] + counts[:shift]:
                dsns = {shard.name: shard.dsn for shard in servers[:shards]}
                start = time.time() + 1.0  # every client warm by then
                end = start + SPIN_SECONDS
                pending = pool.map_async(_spin, [(dsns, start, end)] * SPIN_PROCESSES, 1)
                time.sleep(max(0.0, start - time.time()))
                before = _backend_cpu(servers)
                time.sleep(max(0.0, end + SPIN_LINGER / 5 - time.time()))
                server = _cpu_since(before, servers)
                done = pending.get(timeout=60)
                cycles = sum(c for c, _, _ in done)
                client = sum(cpu for _, cpu, _ in done)
                late = max(late, *(began for _, _, began in done))
                found[shards].append(
                    (cycles / SPIN_SECONDS, client / cycles * 1e6, server / cycles / 1e3)
                )
    return {
        "processes": SPIN_PROCESSES,
        "strategy": "reuse",
        "seconds": SPIN_SECONDS,
        "rounds": SPIN_ROUNDS,
        # The latest a client began a window (its warm-up outlasted the lead): a check.
        "late_seconds": late,
        # Per shard count: the medians over rounds of cycles/s and CPU us per cycle.
        "runs": [
            {
                "shards": n,
                "rate": statistics.median(r for r, _, _ in found[n]),
                "client_us": statistics.median(c for _, c, _ in found[n]),
                "server_us": statistics.median(s for _, _, s in found[n]),
            }
            for n in counts
        ],
    }


# --- the question ---------------------------------------------------------------------------


add_arguments = no_arguments


def measure(ctx: Context, args: argparse.Namespace) -> dict[str, Any]:
    per_shard = {name: 0 for name in SHARDS}
    for n in range(HOLD):
        per_shard[rendezvous(lock_key(hold_name(n)), SHARDS)] += 1
    needed, chosen = locks_needed(per_shard)
    with shard_servers(ctx.work / "shards", chosen) as servers:
        table = lock_table(servers, chosen)
        table["needed_locks_per_transaction"] = needed
        print("  8a. routing a name against a lock cycle", flush=True)
        routing = measure_routing(servers)
        print(f"  8b. {HOLD:,} locks held at once over 3 shards", flush=True)
        held = measure_held(servers, per_shard)
        print("  8c. lock cycles per second with 1, 2 and 3 shards", flush=True)
        throughput = measure_throughput(servers)
    return {
        "cores": os.cpu_count(),
        "shards": list(SHARDS),
        "idle_sessions": PglockConfig().idle_sessions,
        "shared_sessions": PglockConfig().shared_sessions,
        "lock_table": table,
        "routing": routing,
        "held": held,
        "throughput": throughput,
    }


if __name__ == "__main__":
    sys.exit(cli.main([sys.modules[__name__]], "python -m bench.shards", TITLE))
