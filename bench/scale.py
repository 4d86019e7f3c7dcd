"""Section 7: how does the lock scale? Costs against the number of locks on the server,
sessions and server memory for 1,000 concurrent holders, lock throughput against
the server's own limit.

- Flat costs: a lock cycle, ``held()`` and a reported skip while other sessions hold
  0, 1,000 and 10,000 advisory locks, in rounds that rotate the three levels, and
  a ``pg_locks`` read (what a hand-rolled holder lookup does) as the yardstick.
- Holders: real gevent workers (``-P gevent``) running 1,000 calls at once, each
  holding a lock of its own, under ``reuse`` and ``shared``; then 10,000 across
  4 such workers under ``shared``. Lock sessions are counted by the run's own
  application_name prefix; memory is the private memory (``RssAnon``) of their
  backends, read from /proc (the server must be local).
- Throughput: lock cycles per second with 1, 4 and 16 clients, against pgbench
  running the same two statements (``pg_try_advisory_lock`` then
  ``pg_advisory_unlock``, prepared, from C): the server's own limit here.

Runs alone, one part or all (a part not run keeps its stored figures), rewrites
``bench/results/scale.json`` and renders BENCHMARKS.md and bench/scale.png::

    python -m bench.scale [--dsn DSN] [--scale flat,holders,throughput]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import multiprocessing
import os
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import redis
from celery import Celery

from bench import cli
from bench.common import (
    NOT_AVAILABLE,
    ROOT,
    Context,
    ForeignLocks,
    close_sessions,
    load,
    settled,
    shared_config,
    timed,
)
from bench.server import system_bindir
from bench.workers import worker
from pglock_celery import TenantLockedTask
from pglock_celery.config import PglockConfig
from pglock_celery.inspect import find_holder
from pglock_celery.keys import lock_key
from pglock_celery.lock import AdvisoryLock
from tasks.services import wait_until

NAME, SECTION, TITLE = "scale", "7", "scale"
PARTS = ("flat", "holders", "throughput")

LEVELS = (0, 1_000, 10_000)
FLAT_ROUNDS = 6
FLAT_PER_ROUND = 150
#: A pg_locks read costs milliseconds with 10,000 locks: fewer samples.
PG_LOCKS_PER_ROUND = 15
SKIP_TENANT = -999

CYCLE, HELD, SKIP, PG_LOCKS = "lock cycle", "held()", "reported skip", "pg_locks read"

HOLDERS = 1_000
MANY_HOLDERS, MANY_PROCESSES = 10_000, 4
#: How long the holders may take to all hold their locks.
HOLD_TIMEOUT = 120.0

CLIENTS = (1, 4, 16)
SPIN_SECONDS = 1
SPIN_ROUNDS = 2
PGBENCH = "pgbench: the two statements, prepared, from C"
REUSE_CYCLES = "pglock reuse (a process per client)"
SHARED_CYCLES = "pglock shared (a thread per client, one process)"


# --- flat costs ------------------------------------------------------------------------


def _skipper(dsn: str, strategy: str) -> Callable[[], object]:
    """A TenantLockedTask call that skips, reporting its holder, on an app of its own."""
    app = Celery(f"pglock_bench_{strategy}", set_as_current=False)
    app.conf.update(pglock_dsn=dsn, pglock_strategy=strategy, pglock_report_holder=True)

    @app.task(base=TenantLockedTask, name=f"bench.scale.skip_{strategy}")
    def step(tenant_id: int) -> None:
        raise AssertionError("the lock is held elsewhere: this call must skip")

    def skip() -> object:
        result = step(SKIP_TENANT)
        assert result["skipped"], result
        return result

    return skip


def _cycle(config: PglockConfig, tag: str) -> Callable[[], None]:
    count = iter(range(10**9))

    def once() -> None:
        with AdvisoryLock(f"bench-flat:{tag}:{next(count)}", config=config) as lock:
            assert lock.acquired

    return once


def measure_flat(dsn: str) -> dict[str, Any]:
    """Each operation's p50 with 0, 1,000 and 10,000 foreign locks, levels rotated per round."""
    strategies = {"reuse": PglockConfig(dsn=dsn, strategy="reuse")}
    shared = shared_config(dsn)
    if shared is not None:
        strategies["shared"] = shared
    tag = uuid.uuid4().hex[:6]
    samples: dict[tuple[str, str, int], list[float]] = {}
    seen: dict[int, int] = {}
    foreign = ForeignLocks(dsn)
    with contextlib.ExitStack() as stack:
        stack.callback(foreign.close)
        stack.callback(close_sessions)
        # The skipped calls' holder: a lock session of another process would do as well;
        # this one is the library's own, so that its holder report finds it by name.
        holder = AdvisoryLock(f"tenant:{SKIP_TENANT}", config=strategies["reuse"])
        stack.enter_context(holder)
        assert holder.acquired
        plain = stack.enter_context(psycopg.connect(dsn, autocommit=True))
        ops: dict[tuple[str, str], Callable[[], object]] = {}
        for strategy, config in strategies.items():
            held = stack.enter_context(AdvisoryLock(f"bench-flat:{tag}:{strategy}", config=config))
            assert held.acquired
            ops[(CYCLE, strategy)] = _cycle(config, f"{tag}:{strategy}")
            ops[(HELD, strategy)] = held.held
            ops[(SKIP, strategy)] = _skipper(dsn, strategy)
        key = lock_key(f"tenant:{SKIP_TENANT}")
        ops[(PG_LOCKS, "hand-rolled")] = lambda: find_holder(plain, key)
        for once in ops.values():
            timed(once, 10)  # sessions open, statements prepared, caches warm: not counted
        for round_number in range(FLAT_ROUNDS):
            shift = round_number % len(LEVELS)
            for level in LEVELS[shift:] + LEVELS[:shift]:
                foreign.hold(level)
                seen[level] = _advisory_locks(plain)
                for (operation, strategy), once in ops.items():
                    count = PG_LOCKS_PER_ROUND if operation == PG_LOCKS else FLAT_PER_ROUND
                    samples.setdefault((operation, strategy, level), []).extend(timed(once, count))
    return {
        "levels": list(LEVELS),
        "rounds": FLAT_ROUNDS,
        # Each (operation, strategy, foreign locks): its p50 in seconds.
        "p50": [
            {"operation": op, "strategy": strategy, "level": level, "seconds": statistics.median(v)}
            for (op, strategy, level), v in samples.items()
        ],
        # Foreign locks asked for -> advisory locks seen on the server (a check).
        "seen": {str(level): n for level, n in seen.items()},
        "samples": {op: len(v) for (op, _, level), v in samples.items() if not level},
    }


def _advisory_locks(conn: psycopg.Connection[Any]) -> int:
    row = conn.execute("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'").fetchone()
    return int(row[0]) if row else 0


# --- holders: lock sessions and server memory -------------------------------------------


@dataclass
class HolderRun:
    strategy: str
    #: "celery -P gevent" (real workers) or "bench.holders" (the library alone).
    how: str
    processes: int
    holders: int
    #: Holders that held their lock at the same time.
    held: int = 0
    #: Lock sessions of the run at peak, and the advisory locks they held.
    sessions: int = 0
    locks: int = 0
    #: Private memory (RssAnon) and resident memory (VmRSS) of those backends, kB.
    private_kb: int | None = None
    rss_kb: int | None = None
    #: Seconds from the start to every holder holding.
    seconds: float = 0.0
    #: Lock sessions still open once every holder is done (idle, kept for reuse).
    left: int = 0
    note: str = ""


CELERY, PLAIN = "celery -P gevent", "bench.holders"
_RUN_SESSIONS = "SELECT pid FROM pg_stat_activity WHERE application_name LIKE %s"
_RUN_LOCKS = (
    "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid"
    " WHERE l.locktype = 'advisory' AND a.application_name LIKE %s"
)


def backend_memory(pids: list[int]) -> tuple[int, int] | None:
    """Sum of (RssAnon, VmRSS) in kB over server backends, or None if not local."""
    private = resident = 0
    for pid in pids:
        try:
            if b"postgres" not in Path(f"/proc/{pid}/cmdline").read_bytes():
                return None  # that pid is not a backend here: the server is elsewhere
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            return None
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        private += int(fields["RssAnon"].split()[0])
        resident += int(fields["VmRSS"].split()[0])
    return private, resident


def hold_run(
    dsn: str, broker: str, strategy: str, how: str, processes: int, holders: int, logs: Path
) -> HolderRun:
    """``holders`` locks held at once by ``processes`` processes, measured at peak."""
    run = HolderRun(strategy, how, processes, holders)
    # The run's own sessions, whatever else the server has: a prefix of its own.
    prefix = f"pgb{uuid.uuid4().hex[:8]}"
    pattern = prefix + "%"
    start = _celery_holders if how == CELERY else _plain_holders
    with psycopg.connect(dsn, autocommit=True) as probe:

        def run_locks() -> int:
            return int(probe.execute(_RUN_LOCKS, (pattern,)).fetchone()[0])  # type: ignore[index]

        with start(dsn, broker, strategy, processes, holders, prefix, logs) as holders_:
            started = time.perf_counter()
            run.held = holders_.hold()
            run.seconds = time.perf_counter() - started
            peak: list[int] = []
            for _ in range(3):
                pids = [row[0] for row in probe.execute(_RUN_SESSIONS, (pattern,))]
                peak = max(peak, pids, key=len)
                time.sleep(0.2)
            run.sessions = len(peak)
            memory = backend_memory(peak)
            if memory is not None:
                run.private_kb, run.rss_kb = memory
            run.locks = run_locks()
            holders_.let_go()
            wait_until(lambda: run_locks() == 0, HOLD_TIMEOUT, "the holders to let go", 0.2)
            run.left = settled(lambda: len(probe.execute(_RUN_SESSIONS, (pattern,)).fetchall()))
            errors = holders_.errors()
    if run.held < holders:
        run.note = f"{holders - run.held:,} of {holders:,} did not hold: " + (
            errors or f"see the logs in {logs}"
        )
    return run


@dataclass
class Holders:
    """Started holders: ``hold()`` waits until they hold (returns how many do)."""

    hold: Callable[[], int]
    let_go: Callable[[], None]
    errors: Callable[[], str]


@contextlib.contextmanager
def _celery_holders(
    dsn: str, broker: str, strategy: str, processes: int, holders: int, prefix: str, logs: Path
) -> Iterator[Holders]:
    """Gevent workers running ``hold_until`` calls, let go by a flag file."""
    from bench.app import app

    queue, flag = f"pglock-bench-{prefix}", logs / f"{prefix}.released"
    counter = f"pglock-bench:{prefix}"
    env = {
        "PGLOCK_DSN": dsn,
        "PGLOCK_BENCH_BROKER": broker,
        "PGLOCK_STRATEGY": strategy,
        "PGLOCK_APPLICATION_NAME": prefix,
        "PGLOCK_BENCH_QUEUE": queue,
    }
    client = redis.Redis.from_url(broker)
    # Room for more calls than its share in each worker: a worker that reserved some
    # of another's share must still run them all at once.
    per = holders // processes + max(10, holders // processes // 10)
    with contextlib.ExitStack() as stack:
        worker_logs = [
            stack.enter_context(
                worker(env, logs, concurrency=per, pool="gevent", prefetch_multiplier=1)
            )
            for _ in range(processes)
        ]
        stack.callback(client.delete, counter)
        stack.callback(flag.touch)  # whatever happens, the holders let go

        def hold() -> int:
            task = app.tasks["bench.app.hold_until"]
            with app.producer_or_acquire() as producer, producer.batch(max_size=500):
                for n in range(holders):
                    task.apply_async((n, str(flag), counter), queue=queue, producer=producer)
            return _wait_for(lambda: int(client.get(counter) or 0), holders)

        yield Holders(hold, flag.touch, lambda: _errors(worker_logs))


@contextlib.contextmanager
def _plain_holders(
    dsn: str, broker: str, strategy: str, processes: int, holders: int, prefix: str, logs: Path
) -> Iterator[Holders]:
    """bench.holders processes, let go by a line on their stdin."""
    per = holders // processes
    with contextlib.ExitStack() as stack:
        children: list[subprocess.Popen[str]] = []
        for n in range(processes):
            err = stack.enter_context((logs / f"{prefix}-{n}.err").open("w"))
            child = subprocess.Popen(
                [sys.executable, "-m", "bench.holders", dsn, strategy, str(per), prefix],
                cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, text=True,
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
            )  # fmt: skip
            stack.callback(_ended, child)
            children.append(child)

        def hold() -> int:
            held = 0
            for child in children:
                assert child.stdout is not None
                line = child.stdout.readline().split()
                held += int(line[1]) if line[:1] == ["held"] else 0
            return held

        def let_go() -> None:
            for child in children:
                assert child.stdin is not None and child.stdout is not None
                child.stdin.write("release\n")
                child.stdin.flush()
            for child in children:
                assert child.stdout is not None
                child.stdout.readline()  # "released"

        def errors() -> str:
            return "; ".join(
                text.strip()
                for n in range(processes)
                if (text := (logs / f"{prefix}-{n}.err").read_text()).strip()
            )

        yield Holders(hold, let_go, errors)


def _ended(child: subprocess.Popen[str]) -> None:
    """End a holder process (its stdin closed: it lets go if it still holds), killed if it hangs."""
    try:
        assert child.stdin is not None
        with contextlib.suppress(OSError):
            child.stdin.write("release\n")
        with contextlib.suppress(OSError):
            child.stdin.close()
        child.wait(HOLD_TIMEOUT)
    except (OSError, subprocess.TimeoutExpired):
        child.kill()
        child.wait()
    finally:
        if child.stdout is not None:
            child.stdout.close()


def _wait_for(count: Callable[[], int], holders: int) -> int:
    """Wait until ``count()`` reaches ``holders``, or stops growing for 10 s."""
    begun = time.monotonic()
    last, since = -1, begun
    while time.monotonic() < begun + HOLD_TIMEOUT:
        held = count()
        if held >= holders:
            return held
        if held != last:
            last, since = held, time.monotonic()
        elif time.monotonic() - since > 10:
            break
        time.sleep(0.1)
    return max(last, 0)


def _errors(logs: list[Path]) -> str:
    """The distinct errors the workers' calls raised, with their counts."""
    found: dict[str, int] = {}
    for log in logs:
        for match in re.finditer(r"raised unexpected: (.*)", log.read_text(errors="replace")):
            found[match.group(1)] = found.get(match.group(1), 0) + 1
    return "; ".join(f"{count:,} x `{error}`" for error, count in found.items())


def measure_holders(dsn: str, broker: str, logs: Path) -> list[HolderRun]:
    runs = [hold_run(dsn, broker, "reuse", CELERY, 1, HOLDERS, logs)]
    if shared_config(dsn) is None:
        runs += [
            HolderRun("shared", CELERY, 1, HOLDERS, note=NOT_AVAILABLE),
            HolderRun("shared", PLAIN, MANY_PROCESSES, MANY_HOLDERS, note=NOT_AVAILABLE),
        ]
    else:
        runs += [
            hold_run(dsn, broker, "shared", CELERY, 1, HOLDERS, logs),
            hold_run(dsn, broker, "shared", PLAIN, MANY_PROCESSES, MANY_HOLDERS, logs),
        ]
    return runs


# --- throughput --------------------------------------------------------------------------


def _spin(args: tuple[str, float, float]) -> int:
    """One client process: pglock ``reuse`` lock cycles between ``start`` and ``end``."""
    dsn, start, end = args
    once = _cycle(PglockConfig(dsn=dsn, strategy="reuse"), uuid.uuid4().hex[:6])
    try:
        for _ in range(5):
            once()
        return _until(once, start, end)
    finally:
        close_sessions()


def _until(once: Callable[[], None], start: float, end: float) -> int:
    time.sleep(max(0.0, start - time.time()))
    cycles = 0
    while time.time() < end:
        once()
        cycles += 1
    return cycles


def _spin_threads(args: tuple[str, int, float, float]) -> int:
    """``clients`` threads of one process, all on the ``shared`` strategy."""
    dsn, clients, start, end = args
    config = shared_config(dsn)
    assert config is not None
    counts = [0] * clients

    def client(n: int) -> None:
        once = _cycle(config, f"{uuid.uuid4().hex[:6]}:{n}")
        for _ in range(5):
            once()
        counts[n] = _until(once, start, end)

    threads = [threading.Thread(target=client, args=(n,)) for n in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    close_sessions()
    return sum(counts)


PGBENCH_SCRIPT = """\\set k random(1, 1000000000)
SELECT pg_try_advisory_lock(:k);
SELECT pg_advisory_unlock(:k);
"""


def pgbench() -> str | None:
    """The pgbench binary: on the PATH, else next to the benchmark server's binaries."""
    bindir = system_bindir()
    return shutil.which("pgbench") or (str(bindir / "pgbench") if bindir else None)


def _pgbench(dsn: str, clients: int, script: Path) -> float | None:
    found = pgbench()
    if found is None:
        return None
    done = subprocess.run(
        [found, "-n", "-M", "prepared", "-f", str(script), "-c", str(clients),
         "-j", str(min(clients, os.cpu_count() or 1)), "-T", str(SPIN_SECONDS), dsn],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    match = re.search(r"tps = ([0-9.]+) \(without initial connection time\)", done.stdout)
    return float(match.group(1)) if match else None


def measure_throughput(dsn: str, work: Path) -> dict[str, Any]:
    """Cycles per second of each method and client count, in rotating interleaved rounds."""
    script = work / "pgbench-advisory.sql"
    script.write_text(PGBENCH_SCRIPT)
    methods = [PGBENCH, REUSE_CYCLES, SHARED_CYCLES]
    has_shared = shared_config(dsn) is not None
    rates: dict[tuple[str, int], list[float]] = {}
    notes = {} if has_shared else {SHARED_CYCLES: NOT_AVAILABLE}
    if pgbench() is None:
        notes[PGBENCH] = "pgbench not found"
    spawn = multiprocessing.get_context("spawn")
    with spawn.Pool(max(CLIENTS)) as pool:
        for round_number in range(SPIN_ROUNDS):
            shift = round_number % len(methods)
            for method in methods[shift:] + methods[:shift]:
                if method in notes:
                    continue
                for clients in CLIENTS:
                    start = time.time() + 0.5  # every client connected and warm by then
                    end = start + SPIN_SECONDS
                    if method == PGBENCH:
                        rate = _pgbench(dsn, clients, script)
                    elif method == SHARED_CYCLES:
                        rate = pool.apply(_spin_threads, ((dsn, clients, start, end),))
                        rate /= SPIN_SECONDS
                    else:
                        args = [(dsn, start, end)] * clients
                        rate = sum(pool.map(_spin, args, chunksize=1)) / SPIN_SECONDS
                    if rate is not None:
                        rates.setdefault((method, clients), []).append(rate)
    return {
        "seconds": SPIN_SECONDS,
        "rounds": SPIN_ROUNDS,
        "clients": list(CLIENTS),
        "methods": methods,
        # Each (method, clients): lock cycles per second, the median over rounds.
        "rates": [
            {"method": method, "clients": clients, "rate": statistics.median(found)}
            for (method, clients), found in rates.items()
        ],
        "notes": notes,
    }


# --- the question -----------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--scale", default=",".join(PARTS), help="parts of section 7 to run (default: all)"
    )


def measure(ctx: Context, args: argparse.Namespace) -> dict[str, Any]:
    """The parts asked for; a part not run keeps the figures stored by an earlier run."""
    parts = [part.strip() for part in args.scale.split(",")]
    unknown = set(parts) - set(PARTS)
    if unknown:
        raise SystemExit(f"no part {', '.join(sorted(unknown))} of section 7: pick from {PARTS}")
    stored = load(NAME, Path(args.results)) or {}
    figures: dict[str, Any] = {part: stored.get(part) for part in PARTS}
    figures["parts_measured"] = parts
    if "flat" in parts:
        print("  7a. costs with 0, 1,000 and 10,000 foreign locks", flush=True)
        figures["flat"] = measure_flat(ctx.dsn)
    if "holders" in parts:
        print("  7b. 1,000 and 10,000 concurrent holders in gevent workers", flush=True)
        holders = measure_holders(ctx.dsn, ctx.broker, ctx.work)
        figures["holders"] = {
            "holders": HOLDERS,
            "runs": [dataclasses.asdict(run) for run in holders],
        }
    if "throughput" in parts:
        print("  7c. lock throughput with 1, 4 and 16 clients", flush=True)
        figures["throughput"] = measure_throughput(ctx.dsn, ctx.work)
    return figures


if __name__ == "__main__":
    sys.exit(cli.main([sys.modules[__name__]], "python -m bench.scale", TITLE))
