"""`make soak ARGS="--patroni"`: the orchestrator under faults and Patroni failovers.

    python -m tests.chaos.soak --patroni [--strategy reuse|connect] --duration 600

A 3-member Patroni + etcd cluster (tests/support/patroni.py: ttl 20 s, synchronous
mode, strict), an embedded Redis, and the orchestrator in a database of its own
created on the leader. The replicas reach the cluster through multi-host DSNs with
target_session_attrs=read-write, each listing the members in another order, with
PGLOCK_PATRONI_URL naming every member (a lock is valid only while its server is
confirmed as the leader), PGLOCK_CONNECT_TIMEOUT=2 and PGLOCK_STRATEGY from
``--strategy``.

Faults: those of mix.py on the orchestrator's side (replica kill and pause, lock
session termination, Redis restart) and, every FAILOVER_SPACING seconds at the
soonest, a failover striking the leader: a switchover; its postmaster SIGKILLed
(Patroni starts it again); its Patroni SIGKILLed (restarted once another member
leads, or after TAKEOVER_TIMEOUT); its Patroni paused by SIGSTOP for 4 to 30 s
(below the fence's 11 s window, or past the ttl, when another member takes over).
Failovers come in rounds, every kind once per round. Before each one the cluster
must be whole again: a leader, every member streaming, a synchronous standby.

The verdict is the soak's (0 overlapping steps, 0 duplicate training jobs, 0 lost
tenants, some fault hit) and a failover must have struck. Per failover it prints
which member led after it and when, and from the step history (server timestamps,
the same clock as the events') how long until the next step started, and the
longest time without a step start until the next failover: when steps ran again.
The logs directory keeps the replicas' logs, each member's Patroni log
(patroni-m0.log, ...) and the step history (steps.csv).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import random
import shutil
import signal
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import psycopg
from psycopg import sql

from tasks import fleet
from tasks.report import Summary
from tasks.run import schema_dsn
from tests.chaos import mix
from tests.support.orchestra import Orchestra
from tests.support.patroni import (
    PATRONI_VENV,
    ClusterUnavailable,
    Member,
    PatroniCluster,
    ensure_tools,
)
from tests.support.services import EmbeddedRedis, wait_until

STRATEGIES = ("reuse", "connect")
FAILOVERS = ("switchover", "kill-postgres", "kill-patroni", "pause-patroni")
KINDS = (*mix.ORCHESTRA_FAULTS, *FAILOVERS)
#: The orchestrator's database, created on the leader.
DATABASE = "pglock_soak"
REPLICAS = 3
#: Seconds of the other faults at least between two failovers: steps run in between.
FAILOVER_SPACING = 15.0
#: Seconds the cluster may take to be whole again (a leader, every member streaming,
#: a synchronous standby): a deposed primary is rewound, or copied afresh, first.
HEAL_TIMEOUT = 180.0
#: Seconds for another member to take over from a killed Patroni: its key lives out
#: the ttl (20 s) first; the failover tests measured 25 s.
TAKEOVER_TIMEOUT = 60.0
STEP_HISTORY_CSV = "COPY (SELECT * FROM step_history ORDER BY started_at) TO STDOUT CSV HEADER"
#: How long a paused Patroni stays paused (s): the fence's window is 11 s, the ttl 20 s.
PATRONI_PAUSE = (4.0, 30.0)


@dataclass(frozen=True)
class Failover:
    """One failover struck: its kind, when (wall clock), the member that led, what it did."""

    kind: str
    at: float
    leader: str
    what: str


@dataclass(frozen=True)
class Recovery:
    """How steps went on after an event, in seconds from it.

    ``next_step``: until the first step started after it; ``pause``: the longest time in
    the window without a step start; ``resumed``: until the step that ended that pause
    (None when no step started in the window).
    """

    next_step: float | None
    pause: float
    resumed: float | None


def recovery(event: float, starts: Sequence[float], until: float) -> Recovery:
    """Steps after ``event`` up to ``until``, from the sorted start times ``starts``."""
    after = [s for s in starts if event < s <= until]
    points = [event, *after]
    gaps = [later - earlier for earlier, later in itertools.pairwise(points)]
    # The time from the last step to ``until`` is a pause that no step ended.
    tail = until - points[-1]
    if not gaps or tail > max(gaps):
        return Recovery(next_step=after[0] - event if after else None, pause=tail, resumed=None)
    longest = gaps.index(max(gaps))
    return Recovery(next_step=after[0] - event, pause=gaps[longest], resumed=after[longest] - event)


def taken_over(
    changes: Sequence[tuple[float, str | None]], event: float, old: str, until: float
) -> tuple[float, str] | None:
    """The first member but ``old`` seen leading in [event, until]: (seconds, name).

    ``changes`` are the leader's, as (time, name or None); None when no other member led.
    """
    for at, name in changes:
        if event <= at <= until and name is not None and name != old:
            return at - event, name
    return None


class Schedule:
    """Chooses each fault's kind: a failover, or one of the other faults in between.

    A failover comes once ``spacing`` seconds have passed since the last one ended
    (``rest``). Failovers come in rounds, each kind once per round in a random order, so that a
    short soak strikes every kind before any twice.
    """

    def __init__(self, rng: random.Random, spacing: float, start: float) -> None:
        self.rng = rng
        self.spacing = spacing
        self._rested_since = start
        self._round: list[str] = []

    def next(self, now: float) -> str:
        if now - self._rested_since < self.spacing:
            return self.rng.choice(mix.ORCHESTRA_FAULTS)
        if not self._round:
            self._round = self.rng.sample(FAILOVERS, len(FAILOVERS))
        return self._round.pop()

    def rest(self, now: float) -> None:
        """A failover ended at ``now``: the next waits ``spacing`` seconds from here."""
        self._rested_since = now


def verdict(
    faults: Counter[str], summary: Summary, lost: list[str], failovers: list[Failover]
) -> list[str]:
    """The soak's verdict, and a failover soak without a failover tested no failover."""
    problems = mix.verdict(faults, summary, lost)
    if not failovers:
        problems.append("no failover struck the leader: the soak tested no failover")
    return problems


class LeaderWatch:
    """Polls which member says it leads; keeps each change as (wall clock, name or None).

    A poll takes up to 0.3 s (a paused member answers nothing) and comes 0.1 s after the
    last: a change is seen within about 0.4 s.
    """

    def __init__(self, cluster: PatroniCluster) -> None:
        self.cluster = cluster
        self.changes: list[tuple[float, str | None]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        last: object = object()
        while not self._stop.wait(0.1):
            leader = self.cluster.leader(timeout=0.3)
            name = leader.name if leader else None
            if name != last:
                self.changes.append((time.time(), name))
                last = name

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)


# -- the failovers: each strikes the leader, returns what it did (None: nothing) --------


def _switchover(cluster: PatroniCluster, leader: Member, rng: random.Random) -> str | None:
    try:
        _old, new = cluster.switchover()
    except RuntimeError as exc:
        print(f"soak: {exc}", flush=True)
        return None
    return f"to {new.name}"


def _kill_postgres(cluster: PatroniCluster, leader: Member, rng: random.Random) -> str | None:
    pid = leader.postmaster_pid()
    if pid is None:
        return None
    os.kill(pid, signal.SIGKILL)
    return "its postmaster SIGKILLed"


def _kill_patroni(cluster: PatroniCluster, leader: Member, rng: random.Random) -> str | None:
    process = leader.process
    if process is None or process.poll() is not None:
        return None
    process.kill()
    process.wait()

    def another() -> str:
        current = cluster.leader()
        return current.name if current is not None and current is not leader else ""

    try:
        new = wait_until(another, TAKEOVER_TIMEOUT, "another member to lead", interval=0.2)
        outcome = f"{new} took over"
    except AssertionError:
        outcome = f"no other member led within {TAKEOVER_TIMEOUT:.0f} s"
    _restart_patroni(cluster, leader)
    return f"its Patroni SIGKILLed; {outcome}; restarted"


def _restart_patroni(cluster: PatroniCluster, member: Member) -> None:
    """Start ``member``'s Patroni again, as the cluster's account and into its log.

    PatroniCluster has no restart of its own: this spawns it as start() does, and
    stop() ends it by ``member.process``.
    """
    command = [str(PATRONI_VENV / "bin" / "patroni"), str(member.base / "patroni.yml")]
    member.process = cluster._spawn(command, member.log)


def _pause_patroni(cluster: PatroniCluster, leader: Member, rng: random.Random) -> str | None:
    pid = leader.patroni_pid
    if pid is None:
        return None
    seconds = rng.uniform(*PATRONI_PAUSE)
    os.kill(pid, signal.SIGSTOP)
    try:
        time.sleep(seconds)  # the length of the pause is the fault
    finally:
        os.kill(pid, signal.SIGCONT)
    return f"its Patroni paused {seconds:.0f} s"


STRIKES: dict[str, Callable[[PatroniCluster, Member, random.Random], str | None]] = {
    "switchover": _switchover,
    "kill-postgres": _kill_postgres,
    "kill-patroni": _kill_patroni,
    "pause-patroni": _pause_patroni,
}


# -- the soak ---------------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    """Run the failover soak; return its exit status.

    ``args`` are the soak's: --duration, --tenants, --interval, --recovery, --seed and
    --strategy.
    """
    strategy = args.strategy or "reuse"
    seed = args.seed if args.seed is not None else int(time.time())
    rng = random.Random(seed)
    try:
        # What `make test` builds too (etcd, Patroni's venv, the account Patroni runs as),
        # before the cluster is made: it is made for that account.
        ensure_tools()
    except ClusterUnavailable as exc:
        print(f"soak: {exc}; build it: .venv/bin/python -m tests.support.patroni --install")
        return 2
    base = Path(tempfile.mkdtemp(prefix="pglock-soak-"))
    faults: Counter[str] = Counter()
    failovers: list[Failover] = []
    cluster = PatroniCluster()
    redis = EmbeddedRedis(base / "redis")
    print(
        f"soak: seed {seed}, {args.duration:.0f} s of faults and failovers on a "
        f"{cluster.size}-member Patroni cluster, strategy {strategy}, logs in {base}",
        flush=True,
    )
    with contextlib.ExitStack() as cleanup:
        # Undone last to first, each also when an earlier one failed: the cluster's own
        # logs are copied next to the orchestrator's before it is stopped and removed.
        cleanup.callback(cluster.stop)
        cleanup.callback(_keep_logs, cluster, base)
        try:
            cluster.start()
        except ClusterUnavailable as exc:
            print(f"soak: {exc}; build it: .venv/bin/python -m tests.support.patroni --install")
            return 2
        leader = cluster.wait_healthy(HEAL_TIMEOUT)
        with psycopg.connect(leader.dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(DATABASE)))
        redis.start()
        cleanup.callback(redis.stop)
        orchestra = Orchestra(cluster.dsn(dbname=DATABASE), redis.url, base, None)
        cleanup.callback(orchestra.close)
        orchestra.env.update(
            PGLOCK_PATRONI_URL=cluster.urls,
            PGLOCK_CONNECT_TIMEOUT="2",
            PGLOCK_STRATEGY=strategy,
        )
        orchestra.seed(args.tenants)
        replicas = _replicas(orchestra, cluster)
        orchestra.beat()
        watch = LeaderWatch(cluster)
        cleanup.callback(watch.stop)

        started = time.time()
        schedule = Schedule(rng, FAILOVER_SPACING, time.monotonic())
        deadline = time.monotonic() + args.duration
        while time.monotonic() < deadline:
            time.sleep(rng.uniform(0.5, 1.5) * args.interval)  # the pace of the soak itself
            kind = schedule.next(time.monotonic())
            if kind in STRIKES:
                failover = _strike(kind, cluster, rng, started)
                schedule.rest(time.monotonic())
                if failover is not None:
                    failovers.append(failover)
                    faults[kind] += 1
            elif mix.inject(kind, rng, replicas, orchestra, redis):
                faults[kind] += 1
            _restart_exited(replicas)
        # The recovery window starts from a whole cluster and every replica running.
        cluster.wait_healthy(HEAL_TIMEOUT)
        _restart_exited(replicas)
        before = orchestra.cycles()
        time.sleep(args.recovery)  # the quiet recovery window being measured
        after = orchestra.cycles()
        lost = sorted(t for t, c in after.items() if c <= before.get(t, 0))
        summary = orchestra.summary()
        ended = time.time()
        watch.stop()
        starts = _step_starts(orchestra, base / "steps.csv")
        details = _failover_lines(failovers, watch.changes, starts, started, ended)
    problems = verdict(faults, summary, lost, failovers)
    return mix.report(faults, KINDS, details, summary, lost, problems)


def _replicas(orchestra: Orchestra, cluster: PatroniCluster) -> list[fleet.Process]:
    """Start REPLICAS replicas, each with the members listed in another order.

    A new session goes to the first member of its list that accepts writes.
    """
    size = len(cluster.members)
    started = []
    for n in range(REPLICAS):
        order = [(n + i) % size for i in range(size)]
        dsn = schema_dsn(cluster.dsn(order, dbname=DATABASE), orchestra.schema)
        replica = fleet.replica(n + 1, {**orchestra.env, "PGLOCK_DSN": dsn}, orchestra.log_dir)
        replica.start()
        orchestra.processes.append(replica)
        started.append(replica)
    return started


def _step_starts(orchestra: Orchestra, keep: Path) -> list[float]:
    """The steps' start times (epoch seconds), sorted; the whole history kept in ``keep``.

    The orchestra drops its schema when it closes: the CSV file is what stays of it.
    """
    with orchestra.connect() as conn:
        with keep.open("wb") as out, conn.cursor().copy(STEP_HISTORY_CSV) as copy:
            for data in copy:
                out.write(data)
        rows = conn.execute("SELECT extract(epoch FROM started_at) FROM step_history ORDER BY 1")
        return [float(row[0]) for row in rows]


def _restart_exited(replicas: list[fleet.Process]) -> None:
    for replica in replicas:
        if not replica.alive():
            replica.start()


def _strike(
    kind: str, cluster: PatroniCluster, rng: random.Random, started: float
) -> Failover | None:
    """Wait until the cluster is whole again, then strike its leader with ``kind``."""
    leader = cluster.wait_healthy(HEAL_TIMEOUT)
    at = time.time()
    what = STRIKES[kind](cluster, leader, rng)
    outcome = what or "nothing hit"
    print(f"soak: {_when(at, started)} {kind} of {leader.name}: {outcome}", flush=True)
    return Failover(kind, at, leader.name, what) if what is not None else None


def _when(at: float, started: float) -> str:
    """An event's time from the start of the faults, and on the clock of the logs."""
    return f"+{at - started:.0f} s ({time.strftime('%H:%M:%S', time.localtime(at))})"


def _failover_lines(
    failovers: list[Failover],
    changes: Sequence[tuple[float, str | None]],
    starts: Sequence[float],
    started: float,
    ended: float,
) -> list[str]:
    """Two lines per failover: what struck, then who led after it and when steps ran again."""
    lines = [f"failovers          {len(failovers)}"]
    ends = [f.at for f in failovers[1:]] + [ended]
    for failover, until in zip(failovers, ends, strict=True):
        took = taken_over(changes, failover.at, failover.leader, until)
        led = f"{took[1]} led after {took[0]:.1f} s" if took else f"{failover.leader} kept leading"
        steps = recovery(failover.at, starts, until)
        first = "none" if steps.next_step is None else f"{steps.next_step:.1f} s"
        again = (
            f"no step ended it before {'the next failover' if until < ended else 'the end'}"
            if steps.resumed is None
            else f"steps again after {steps.resumed:.1f} s"
        )
        when = _when(failover.at, started)
        lines.append(f"  {when} {failover.kind} of {failover.leader}: {failover.what}")
        lines.append(
            f"      {led}; next step after {first}; longest pause {steps.pause:.1f} s, {again}"
        )
    return lines


def _keep_logs(cluster: PatroniCluster, base: Path) -> None:
    for member in cluster.members:
        with contextlib.suppress(OSError):
            shutil.copy(member.log, base / f"patroni-{member.name}.log")
