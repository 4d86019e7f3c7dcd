"""Failover scenarios: locks and guarded writes across what can happen to a Patroni primary.

Each scenario starts a 3-member Patroni + etcd cluster of its own (ttl 20 s, loop_wait
2 s, retry_timeout 4 s, or Patroni's defaults 30/10/10 where the scenario says so;
synchronous_mode and synchronous_mode_strict; REST APIs over HTTPS with a private CA and
``verify_client: required`` where it says so, the clients given the CA and a client
certificate by pglock_patroni_cafile/_certfile/_keyfile alone), guards a table,
and starts CLIENTS client processes (tests/failover/client.py: the public API only)
whose multi-host DSNs list the members in every order with
target_session_attrs=read-write (by address, or by the name ``localhost`` where the
scenario says so: the fence knows servers by identity, not by how a DSN spells them);
half of them open a session per lock (strategy connect), half reuse theirs. Once every
client has written, the event strikes the primary; the clients run on until locks are
granted again and the cluster has settled.
Then, from every client's records (CLOCK_MONOTONIC, one clock for all):

- 0 overlapping holds of one name (a hold runs from its grant to when its client
  released or learned of the loss; one never closed runs to when the client was stopped),
  but for one kind, reported apart: the event ended the earlier holder's session and a
  surviving backend of the killed server granted the name at once; the earlier holder
  must then have been told within the detection bound with no write acknowledged after
  the grant (records.after_session_loss);
- 0 acknowledged writes missing from the final primary;
- every holder on the deposed primary told (LockLost) before the new primary granted
  its name;
- locks granted again on the final primary within ttl + 10 s of the event;
- where the event makes a replica a rogue primary (promoted behind its paused Patroni),
  no advisory lock ever seen on it, and no client kept from locks meanwhile (fence
  first: a client whose host list reaches the rogue first goes on to the leader).

Each scenario prints its timeline (event, holders told, new leader, first lock) and
numbers, and writes them to $PGLOCK_FAILOVER_REPORT (a JSON lines file) when set.

`make test` runs this module last and alone (``-m failover``): each scenario starts a
cluster of its own.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import psycopg
import pytest

from pglock_celery import install_guard
from pglock_celery.config import PglockConfig
from tests.failover.records import Hold, Records, after_session_loss, overlaps
from tests.support.patroni import ROOT, Member, PatroniCluster
from tests.support.services import wait_until

pytestmark = pytest.mark.failover

CLIENTS = 6
NAMES = [f"fo:{i}" for i in range(4)]
TTL = 20
PAUSE = 25.0
#: How long the clients run before the event (each must have written by then).
WARMUP = 3.0
#: How long they run on once the final primary granted a lock again.
SETTLE = 4.0
#: The library's detection bound with the clients' settings (the defaults): a holder
#: whose session ended learns within it (G11).
DETECTION_BOUND = PglockConfig().client_bound

SETUP_SQL = """
CREATE TABLE fo_rows (
    client int NOT NULL, name text NOT NULL, seq int NOT NULL,
    grant_t double precision NOT NULL, port int NOT NULL
)
"""


@dataclass
class Scenario:
    name: str
    #: Strikes the primary; returns what to undo at the end (or None).
    strike: Callable[[PatroniCluster, Member], Callable[[], None] | None]
    #: Seconds after the event before the clients may be stopped.
    runs_at_least: float
    #: The cluster's dynamic configuration where it is not the tests' own (DCS_CONFIG).
    dcs: dict[str, Any] | None = None
    #: Each member reaches etcd through a relay the strike may cut.
    etcd_relays: bool = False
    #: The strike makes rogue_of(cluster, leader) a second primary; the leader stays.
    rogue: bool = False
    #: Another member must lead before locks count as granted again.
    moves_leader: bool = False
    #: How the clients' DSNs name the members' hosts (Patroni reports 127.0.0.1).
    host: str = "127.0.0.1"
    #: The REST APIs are HTTPS with a private CA and verify_client: required; the
    #: clients' fences get the CA and a client certificate from the pglock settings.
    tls: bool = False

    @property
    def ttl(self) -> int:
        return int((self.dcs or {}).get("ttl", TTL))


#: Patroni's own defaults for the timing keys (what a cluster runs with unless told).
PATRONI_DEFAULTS = {"ttl": 30, "loop_wait": 10, "retry_timeout": 10}


def switchover(cluster: PatroniCluster, leader: Member) -> None:
    cluster.switchover()


def kill_postgres(cluster: PatroniCluster, leader: Member) -> None:
    pid = leader.postmaster_pid()
    assert pid is not None
    os.kill(pid, signal.SIGKILL)


def kill_patroni(cluster: PatroniCluster, leader: Member) -> None:
    assert leader.patroni_pid is not None
    os.kill(leader.patroni_pid, signal.SIGKILL)


def _pause(pids: list[int]) -> Callable[[], None]:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGSTOP)
    resumed = threading.Event()

    def resume() -> None:
        if not resumed.is_set():
            resumed.set()
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)

    timer = threading.Timer(PAUSE, resume)
    timer.daemon = True
    timer.start()
    return resume


def stop_patroni(cluster: PatroniCluster, leader: Member) -> Callable[[], None]:
    assert leader.patroni_pid is not None
    return _pause([leader.patroni_pid])


def cut_from_etcd(cluster: PatroniCluster, leader: Member) -> Callable[[], None]:
    """The leader's Patroni loses etcd; clients and the fence still reach it."""
    return cluster.cut_from_etcd(leader)


def rogue_of(cluster: PatroniCluster, leader: Member) -> Member:
    return next(m for m in cluster.members if m is not leader)


def promote_behind_paused_patroni(cluster: PatroniCluster, leader: Member) -> Callable[[], None]:
    """A replica's Patroni paused, then its Postgres promoted by hand: a second primary
    that accepts writes while the leader still leads (Patroni, resumed, demotes it)."""
    rogue = rogue_of(cluster, leader)
    assert rogue.patroni_pid is not None
    resume = _pause([rogue.patroni_pid])
    cluster.promote_by_hand(rogue)
    return resume


def stop_postgres(cluster: PatroniCluster, leader: Member) -> Callable[[], None]:
    """SIGSTOP the postmaster and every process of it: the whole server freezes."""
    pid = leader.postmaster_pid()
    assert pid is not None
    children = [p.pid for p in psutil.Process(pid).children(recursive=True)]
    return _pause([pid, *children])


SCENARIOS = [
    Scenario("switchover", switchover, 0.0),
    Scenario("sigkill-postgres", kill_postgres, 0.0),
    # Over HTTPS: what sigkill-patroni was over HTTP (defaults-sigkill-patroni keeps that).
    Scenario("https-verify-client-sigkill-patroni", kill_patroni, 0.0, tls=True),
    Scenario("sigstop-patroni-25s", stop_patroni, PAUSE + 5),
    Scenario("sigstop-postgres-25s", stop_postgres, PAUSE + 5),
    Scenario("defaults-sigkill-patroni", kill_patroni, 0.0, dcs=PATRONI_DEFAULTS),
    Scenario("leader-cut-from-etcd", cut_from_etcd, 0.0, etcd_relays=True, moves_leader=True),
    Scenario("switchover-hosts-by-name", switchover, 0.0, host="localhost"),
    Scenario(
        "replica-promoted-behind-paused-patroni",
        promote_behind_paused_patroni,
        PAUSE + 5,
        rogue=True,
    ),
]


class RogueWatch:
    """Polls a server for advisory locks held there; counts every sighting."""

    def __init__(self, member: Member) -> None:
        self.member = member
        self.sightings = 0
        self.polls = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                with psycopg.connect(self.member.dsn, autocommit=True, connect_timeout=2) as conn:
                    while not self._stop.wait(0.02):
                        row = conn.execute(
                            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'"
                        ).fetchone()
                        self.polls += 1
                        self.sightings += bool(row and row[0])
            except psycopg.Error:
                self._stop.wait(0.2)  # restarted by Patroni, or paused: ask again soon

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)


def longest_gap(holds: list[Hold], client: int, start: float, end: float) -> float:
    """The longest time ``client`` went without a grant within [start, end]."""
    grants = sorted(h.grant for h in holds if h.client == client and start <= h.grant <= end)
    edges = [start, *grants, end]
    return max(b - a for a, b in itertools.pairwise(edges))


class LeaderWatch:
    """Polls which member says it leads; keeps each change with its time."""

    def __init__(self, cluster: PatroniCluster) -> None:
        self.cluster = cluster
        self.changes: list[tuple[float, str | None]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        last: object = object()
        while not self._stop.wait(0.1):
            leader = self.cluster.leader(timeout=0.3)  # a paused member answers nothing
            name = leader.name if leader else None
            if name != last:
                self.changes.append((time.monotonic(), name))
                last = name

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)


@contextlib.contextmanager
def clients(
    cluster: PatroniCluster, dsn_db: str, base: Path, host: str = "127.0.0.1"
) -> Iterator[list[Path]]:
    """Start CLIENTS client processes, one host order each, their DSNs naming the hosts
    ``host``; yield their record files."""
    stop = base / "stop"
    outs: list[Path] = []
    procs: list[subprocess.Popen[bytes]] = []
    # A multi-host DSN pays the connect timeout for every frozen host it tries before the
    # new primary: the clients keep it at libpq's least, as the failover page advises.
    env = dict(
        os.environ,
        PGLOCK_PATRONI_URL=cluster.urls,
        PGLOCK_CONNECT_TIMEOUT="2",
        PYTHONPATH=str(ROOT),
        **cluster.tls_settings(),
    )
    orders = itertools.cycle(itertools.permutations(range(len(cluster.members))))
    try:
        for client in range(CLIENTS):
            out = base / f"client-{client}.jsonl"
            outs.append(out)
            dsn = cluster.dsn(next(orders), dbname=dsn_db, host=host)
            # Half the clients open a session per lock (a new session goes to the first
            # host of its list that accepts writes), half reuse their sessions.
            env["PGLOCK_STRATEGY"] = "connect" if client % 2 == 0 else "reuse"
            with (base / f"client-{client}.log").open("wb") as log:
                procs.append(
                    subprocess.Popen(
                        [
                            sys.executable,
                            "-m",
                            "tests.failover.client",
                            str(client),
                            dsn,
                            str(out),
                            str(stop),
                            *NAMES,
                        ],
                        cwd=ROOT,
                        env=dict(env),
                        stdout=log,
                        stderr=subprocess.STDOUT,
                    )
                )
        yield outs
    finally:
        stop.touch()
        deadline = time.monotonic() + 10
        for proc in procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()  # hung in a commit no server will answer
                proc.wait(10)


def acked_by_each(outs: list[Path]) -> bool:
    return all(p.exists() and '"ack"' in p.read_text() for p in outs)


def first_grant_after(outs: list[Path], after: float, port: int | None) -> float | None:
    grants = [
        item["at"]
        for path in outs
        for line in path.read_text().splitlines()
        if line.startswith('{"grant"')
        and (item := json.loads(line))["at"] > after
        and (port is None or item["port"] == port)
    ]
    return min(grants, default=None)


@pytest.mark.parametrize("scenario", SCENARIOS, ids=[s.name for s in SCENARIOS])
def test_failover(
    scenario: Scenario,
    new_patroni: Callable[..., PatroniCluster],
    tmp_path: Path,
) -> None:
    cluster = new_patroni(dcs=scenario.dcs, etcd_relays=scenario.etcd_relays, tls=scenario.tls)
    leader = wait_until(cluster.leader, 60, "a leader")
    with psycopg.connect(leader.dsn, autocommit=True) as conn:
        conn.execute("CREATE DATABASE fo")
    setup_dsn = leader.dsn.replace("dbname=postgres", "dbname=fo")
    with psycopg.connect(setup_dsn, autocommit=True) as conn:
        conn.execute(SETUP_SQL)
    install_guard(setup_dsn, "fo_rows", "{name}")

    watch = LeaderWatch(cluster)
    rogue = RogueWatch(rogue_of(cluster, leader)) if scenario.rogue else None
    undo: Callable[[], None] | None = None
    try:
        with clients(cluster, "fo", tmp_path, scenario.host) as outs:
            wait_until(lambda: acked_by_each(outs), 60, "every client to write")
            time.sleep(WARMUP)  # a steady state before the event, not a synchronisation
            event = time.monotonic()
            undo = scenario.strike(cluster, leader)

            def regranted() -> float | None:
                current = cluster.leader()
                if current is None or time.monotonic() < event + scenario.runs_at_least:
                    return None
                if scenario.moves_leader and current is leader:
                    return None
                return first_grant_after(outs, event + 0.5, current.pg_port)

            with contextlib.suppress(AssertionError):
                wait_until(
                    regranted, scenario.runs_at_least + scenario.ttl + 20, "locks granted again"
                )
            time.sleep(SETTLE)  # the clients keep working on the final primary a while
        stopped_at = time.monotonic()
    finally:
        if undo is not None:
            undo()
        watch.stop()
        if rogue is not None:
            rogue.stop()

    final = wait_until(cluster.leader, 60, "a final leader")
    with psycopg.connect(final.dsn.replace("dbname=postgres", "dbname=fo")) as conn:
        rows = {
            (c, n, s, g)
            for c, n, s, g in conn.execute("SELECT client, name, seq, grant_t FROM fo_rows")
        }
    records = Records.read(outs, stopped_at)
    report = verdict(scenario, records, rows, event, leader, final, watch, stopped_at)
    if rogue is not None:
        report["rogue"] = rogue.member.name
        report["rogue_polls"] = rogue.polls
        report["advisory_locks_seen_on_rogue"] = rogue.sightings
        report["holds_on_rogue"] = sum(1 for h in records.holds if h.port == rogue.member.pg_port)
        # While the rogue runs (until its Patroni resumes and demotes it).
        window = (event + 1, event + PAUSE)
        report["clients_without_a_lock_while_rogue"] = [
            c for c in range(CLIENTS)
            if not any(h.client == c and window[0] <= h.grant <= window[1] for h in records.holds)
        ]  # fmt: skip
        report["longest_wait_for_a_lock_s"] = round(
            max(longest_gap(records.holds, c, event, stopped_at) for c in range(CLIENTS)), 2
        )
    print(json.dumps(report, indent=1))
    if os.environ.get("PGLOCK_FAILOVER_REPORT"):
        with open(os.environ["PGLOCK_FAILOVER_REPORT"], "a") as out:
            out.write(json.dumps(report) + "\n")
    assert report["overlapping_holds"] == 0, report
    assert report["acked_writes_missing"] == 0, report
    assert report["holders_told_before_regrant"] == report["holders_on_old_primary"], report
    assert report["regranted_after_s"] is not None, report
    # Back within ttl + 10 s (issue 25's bound; a killed Patroni measured 25.4 s at ttl 20).
    assert report["regranted_after_s"] <= scenario.ttl + 10, report
    if rogue is not None:
        assert rogue.polls > 0, report
        assert report["advisory_locks_seen_on_rogue"] == 0, report
        assert report["holds_on_rogue"] == 0, report
        # Nobody locked out while the leader is up (before fence first, a client whose
        # host list began with the rogue got no lock for 27 s), and no lock refused.
        assert report["clients_without_a_lock_while_rogue"] == [], report
        assert report["client_failures"] == 0, report


def verdict(
    scenario: Scenario,
    records: Records,
    rows: set[tuple[int, str, int, float]],
    event: float,
    old: Member,
    final: Member,
    watch: LeaderWatch,
    stopped_at: float,
) -> dict[str, Any]:
    """The scenario's numbers and timeline, times in seconds from the event."""
    holds = records.holds

    def session_lost(first: Hold, second: Hold) -> bool:
        return after_session_loss(first, second, records, event, old.pg_port, DETECTION_BOUND)

    pairs = [(a, b) for a, b in overlaps(holds) if not session_lost(a, b)]
    lost_pairs = [(a, b) for a, b in overlaps(holds) if session_lost(a, b)]
    at_event = [
        h for h in holds if h.port == old.pg_port and h.grant <= event < (h.end or stopped_at)
    ]
    # Holds granted on the old primary after the event, where another member leads.
    later_on_old = [
        h for h in holds if h.port == old.pg_port and h.grant > event and final is not old
    ]
    told = 0
    for hold in at_event + later_on_old:
        others = [
            h.grant
            for h in holds
            if h.name == hold.name and h is not hold and h.grant > hold.grant
            and h.port == final.pg_port and h.grant > event and not session_lost(hold, h)
        ]  # fmt: skip
        first_other = min(others, default=None)
        if hold.how != "open" and (first_other is None or (hold.end or 0) <= first_other):
            told += 1
    new_leader = next(
        (t for t, name in watch.changes if t > event and name is not None and name != old.name),
        None,
    )
    regrants = [h.grant for h in holds if h.port == final.pg_port and h.grant > event + 0.5]
    by_name = {
        name: min((h.grant for h in holds if h.name == name and h.grant > event + 0.5
                   and h.port == final.pg_port), default=None)
        for name in NAMES
    }  # fmt: skip

    def example(a: Hold, b: Hold) -> dict[str, Any]:
        def line(h: Hold) -> list[Any]:
            end = round((h.end or 0) - event, 2)
            return [h.client, h.port, round(h.grant - event, 2), end, h.how]

        return {"name": a.name, "a": line(a), "b": line(b)}

    told_at = sorted((h.end or 0) - event for h in at_event + later_on_old if h.how != "released")
    missing = records.acks - rows
    return {
        "scenario": scenario.name,
        "old_leader": old.name,
        "final_leader": final.name,
        "holds": len(holds),
        "acked_writes": len(records.acks),
        "overlapping_holds": len(pairs),
        "overlap_examples": [example(a, b) for a, b in pairs[:5]],
        "overlaps_after_session_loss": [example(a, b) for a, b in lost_pairs],
        "acked_writes_missing": len(missing),
        "holders_on_old_primary": len(at_event) + len(later_on_old),
        "holders_on_old_primary_after_event": len(later_on_old),
        "holders_told_before_regrant": told,
        "holders_never_told": sum(1 for h in at_event + later_on_old if h.how == "open"),
        "told_after_s": [round(told_at[0], 2), round(told_at[-1], 2)] if told_at else None,
        "new_leader_after_s": round(new_leader - event, 2) if new_leader else None,
        "leader_changes_s": [
            (round(t - event, 2), name) for t, name in watch.changes if t > event - 1
        ],
        "regranted_after_s": round(min(regrants) - event, 2) if regrants else None,
        "regranted_each_name_after_s": {
            n: (round(t - event, 2) if t else None) for n, t in by_name.items()
        },
        "client_failures": len(records.failures),
        "ran_s": round(stopped_at - event, 1),
    }
