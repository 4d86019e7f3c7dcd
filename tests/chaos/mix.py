"""What both soaks share: the faults on the orchestrator's side, the verdict, the report.

The faults (ORCHESTRA_FAULTS): SIGKILL of a replica (restarted at once), SIGSTOP of a
replica for a few seconds, termination of a random lock session, a Redis restart
without persistence. ``make soak`` adds its Postgres restarts and the partition
(soak.py), ``make soak ARGS="--patroni"`` its failovers (failover_soak.py).
"""

from __future__ import annotations

import os
import random
import signal
import time
from collections import Counter
from collections.abc import Sequence

import psycopg

from tasks import fleet
from tasks.report import Summary
from tests.support.orchestra import Orchestra
from tests.support.services import EmbeddedRedis

ORCHESTRA_FAULTS = ("kill", "pause", "terminate", "restart-redis")


def inject(
    kind: str,
    rng: random.Random,
    replicas: list[fleet.Process],
    orchestra: Orchestra,
    redis: EmbeddedRedis,
) -> bool:
    """Inject one of ORCHESTRA_FAULTS; return whether it hit something."""
    victim = rng.choice(replicas)
    if kind == "kill":
        victim.kill()
        victim.start()
    elif kind == "pause":
        tree = victim.tree()
        for pid in tree:
            os.kill(pid, signal.SIGSTOP)
        time.sleep(rng.uniform(1, 4))  # the length of the pause is the fault
        for pid in tree:
            os.kill(pid, signal.SIGCONT)
        return bool(tree)
    elif kind == "terminate":
        return _terminate_one(orchestra.dsn)
    elif kind == "restart-redis":
        redis.stop()
        redis.start()
    else:
        raise ValueError(f"not a fault on the orchestrator's side: {kind!r}")
    return True


def _terminate_one(dsn: str) -> bool:
    """End one random lock session of the orchestrator's database; whether there was one."""
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            row = conn.execute(
                "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM ("
                " SELECT pid FROM pg_stat_activity WHERE application_name LIKE 'pglock|%'"
                " AND datname = current_database() ORDER BY random() LIMIT 1) AS victim"
            ).fetchone()
    except psycopg.OperationalError:
        return False  # no server accepts writes now (a failover under way): nothing to end
    return bool(row and row[0])


def verdict(faults: Counter[str], summary: Summary, lost: list[str]) -> list[str]:
    """What makes the soak fail; empty when it passed.

    A soak proves something only when faults hit the system and it kept working.
    """
    problems = []
    if not sum(faults.values()):
        problems.append("no fault hit anything: the soak tested nothing")
    if not summary.steps:
        problems.append("no step ran")
    if summary.overlaps:
        problems.append(f"{summary.overlaps} overlapping steps")
    if summary.duplicate_jobs:
        problems.append(f"{summary.duplicate_jobs} duplicate training jobs")
    if lost:
        problems.append(f"{len(lost)} tenants made no progress after the faults")
    return problems


def report(
    faults: Counter[str],
    kinds: Sequence[str],
    details: Sequence[str],
    summary: Summary,
    lost: list[str],
    problems: list[str],
) -> int:
    """Print the outcome; return the exit status (1 when there are problems).

    The faults that hit and the ``kinds`` that never did, then ``details``, the summary,
    the lost tenants and the problems.
    """
    print(f"\nfaults injected    {sum(faults.values())} {dict(sorted(faults.items()))}")
    missing = sorted(set(kinds) - set(faults))
    if missing:
        print(f"faults not hit     {missing}")
    for line in [*details, *summary.lines()]:
        print(line)
    print(f"lost tenants       {len(lost)} (expected: 0) {lost if lost else ''}")
    for problem in problems:
        print(f"problem: {problem}")
    print("result: FAILED" if problems else "result: OK")
    return 1 if problems else 0
