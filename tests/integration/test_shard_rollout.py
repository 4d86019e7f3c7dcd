"""A rollout from two shards to three with real workers (docs/shards.md, "Changing
the shards"): workers on the old map, the transition and the new map at once, through
every step of ``pglock-celery shards``. No tenant, moving or not, ever has two holders;
a moving tenant's runs come from more than one kind of worker in each step, so an
overlap had its chance; and the new map's workers lock once the old map's are gone."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from celery import Celery
from psycopg.conninfo import make_conninfo

from pglock_celery import LockUnavailable
from pglock_celery.config import PglockConfig
from pglock_celery.keys import lock_key
from pglock_celery.lock import AdvisoryLock
from pglock_celery.shards import parse_shards
from pglock_celery.sources import registry
from tests.apps import core
from tests.support.history import Run, overlaps, read_history
from tests.support.services import own_database, scalar
from tests.support.shard_workers import history_everywhere, start_shard_workers, stop_all

RESULT_TIMEOUT = 90
#: The queue the rollout's workers alone listen on.
QUEUE = f"pglock-rollout-tests-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def three(pg_dsn: str) -> Iterator[dict[str, str]]:
    with own_database(pg_dsn) as a, own_database(pg_dsn) as b, own_database(pg_dsn) as c:
        yield {"a": a, "b": b, "c": c}


@pytest.fixture
def two(three: dict[str, str]) -> dict[str, str]:
    """The old map: shards a and b (the new one adds c)."""
    return {"a": three["a"], "b": three["b"]}


@pytest.fixture
def table(three: dict[str, str]) -> str:
    """One history table, of one name, in every shard's database (dropped with them)."""
    return history_everywhere(three)


def home(shards: dict[str, str], tenant: str) -> str:
    name = f"tenant:{tenant}"
    return PglockConfig(shards=parse_shards(shards)).shard_of(lock_key(name), name)


def tenants_of(
    run_id: str, two: dict[str, str], three: dict[str, str]
) -> tuple[list[str], list[str]]:
    """Six tenants that move from a or b to c, and six that stay where they are."""
    moving, staying = [], []
    for n in range(400):
        tenant = f"{run_id}-{n}"
        (moving if home(two, tenant) != home(three, tenant) else staying).append(tenant)
    assert len(moving) >= 6 and len(staying) >= 6
    return moving[:6], staying[:6]


def runs_everywhere(three: dict[str, str], table: str) -> dict[str, list[Run]]:
    """Every recorded run, by the shard whose database it was written to."""
    return {shard: read_history(dsn, table) for shard, dsn in three.items()}


def run_mix(tenants: list[str], table: str, seed: str, calls: int = 120) -> list[object]:
    """``calls`` locked steps over ``tenants`` on QUEUE, each 5 to 40 ms; their results
    (a refused call's is its LockUnavailable)."""
    rng = random.Random(seed)
    order = [rng.choice(tenants) for _ in range(calls)]
    pending = [
        core.step.apply_async((t, table, rng.uniform(0.005, 0.04)), queue=QUEUE) for t in order
    ]
    return [call.get(timeout=RESULT_TIMEOUT, propagate=False) for call in pending]


def outcomes(results: list[object]) -> dict[str, int]:
    """How many calls ran, skipped (their tenant locked) and were refused (their map)."""
    counted = {"ran": 0, "skipped": 0, "refused": 0}
    for result in results:
        if isinstance(result, LockUnavailable):
            counted["refused"] += 1
        elif isinstance(result, dict) and (result.get("ran") or result.get("skipped")):
            counted["ran" if result.get("ran") else "skipped"] += 1
        else:
            raise AssertionError(f"a call neither ran, skipped nor was refused: {result!r}")
    return counted


def shards_step(new: dict[str, str], old: dict[str, str], *args: str, check: bool = True) -> str:
    """``pglock-celery shards ARGS`` with the change from ``old`` to ``new``: its exit
    code and output (stderr last); with ``check``, a code other than 0 or 1 fails."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PGLOCK_")}
    env.update(PGLOCK_SHARDS=json.dumps(new), PGLOCK_SHARDS_PREVIOUS=json.dumps(old))
    done = subprocess.run(
        [sys.executable, "-m", "pglock_celery.cli", "-A", "tests.apps.bare:app", "shards", *args],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert not check or done.returncode in (0, 1), done.stderr
    return f"exit {done.returncode}\n{done.stdout}{done.stderr}"


def test_old_transition_and_new_map_workers_at_once_give_no_tenant_two_holders(
    app: Celery,
    worker_env: dict[str, str],
    log_dir: Path,
    three: dict[str, str],
    two: dict[str, str],
    table: str,
    run_id: str,
) -> None:
    """Old-map, transition and new-map workers all run from the rollout's begin: the
    new map's are refused until finish, which waits for the old map's to be gone."""
    moving, staying = tenants_of(run_id, two, three)
    tenants = moving + staying
    old = start_shard_workers(app, worker_env, log_dir, QUEUE, two)
    workers = list(old)
    try:
        before = outcomes(run_mix(tenants, table, f"{run_id}-before"))
        assert shards_step(three, two, "begin").startswith("exit 0"), "begin failed"
        workers += start_shard_workers(app, worker_env, log_dir, QUEUE, three, previous=two)
        new = start_shard_workers(app, worker_env, log_dir, QUEUE, three)
        workers += new
        at_once = outcomes(run_mix(tenants, table, f"{run_id}-at-once"))
        held_back = shards_step(three, two, "finish", "--wait", "1")
        assert held_back.startswith("exit 1") and "not finished" in held_back, held_back
        finishing = outcomes(run_mix(tenants, table, f"{run_id}-finishing"))
        stop_all(old)
        finished = shards_step(three, two, "finish", "--wait", "60")
        assert finished.startswith("exit 0") and "finished: map" in finished, finished
        after = outcomes(run_mix(tenants, table, f"{run_id}-after"))
        new_pids = {pid for worker in new for pid in worker.children()}
    finally:
        stop_all(workers)
    runs = runs_everywhere(three, table)
    every = [run for here in runs.values() for run in here]
    where = {id(run): shard for shard, here in runs.items() for run in here}
    assert [
        [(where[id(r)], r.lock_name, r.worker_pid, str(r.started), str(r.finished)) for r in pair]
        for pair in overlaps(every)
    ] == []
    assert len(every) == sum(o["ran"] for o in (before, at_once, finishing, after))
    assert before["refused"] == 0 and after["refused"] == 0, (before, after)
    # The new map's workers took calls and were refused while the old map's ran...
    assert at_once["refused"] and finishing["refused"], (at_once, finishing)
    assert all(o["skipped"] for o in (at_once, finishing, after)), "no call met a held lock"
    names = {f"tenant:{t}" for t in moving}
    on_old = {
        run.worker_pid for shard in ("a", "b") for run in runs[shard] if run.lock_name in names
    }
    on_new = {run.worker_pid for run in runs["c"] if run.lock_name in names}
    assert on_old and on_new, "a moving tenant ran on only one of its shards"
    # ... and ran its moving tenants on c once the old map's were gone.
    assert on_new & new_pids, "no new-map worker ran a moving tenant"


@pytest.mark.parametrize("strategy", ["reuse", "connect", "shared"])
def test_a_new_map_holder_is_refused_until_the_rollout_finishes(
    three: dict[str, str], two: dict[str, str], run_id: str, strategy: str
) -> None:
    """In one process, what the workers above do: without the record an old-map and a
    new-map holder of a moving name do not exclude each other (the hazard); from begin
    the new map's is refused, the transition excluded by the old; after finish the new
    map's holds and the old map's is refused."""
    moving, _ = tenants_of(run_id, two, three)
    name = f"tenant:{moving[0]}"
    # Distinct prefixes: one process, yet each map's sessions apart, as in workers.
    old = PglockConfig(shards=parse_shards(two), application_name="pglock-old", strategy=strategy)
    new = PglockConfig(shards=parse_shards(three), application_name="pglock-new", strategy=strategy)
    transition = PglockConfig(
        shards=parse_shards(three),
        shards_previous=parse_shards(two),
        application_name="pglock-tr",
        strategy=strategy,
    )
    try:
        with AdvisoryLock(name, config=old) as first, AdvisoryLock(name, config=new) as second:
            assert first.acquired and second.acquired, "the maps share a lock: docs/shards.md"
        with pytest.raises(LockUnavailable, match="shards begin"):
            AdvisoryLock(name, config=transition).acquire()
        registry.close()  # the sessions opened before the record: none recorded a map
        assert shards_step(three, two, "begin").startswith("exit 0")
        with AdvisoryLock(name, config=old) as first:
            assert first.acquired
            assert not AdvisoryLock(name, config=transition).acquire()
            with pytest.raises(LockUnavailable, match="not accepted"):
                AdvisoryLock(name, config=new).acquire()
        held_back = shards_step(three, two, "finish", "--wait", "0.5")
        # The old map's idle (reuse) or quiet shared session keeps it from finishing;
        # under connect the session ended with its lock.
        assert held_back.startswith("exit 0" if strategy == "connect" else "exit 1"), held_back
        registry.close()
        assert shards_step(three, two, "finish", "--wait", "10").startswith("exit 0")
        with AdvisoryLock(name, config=new) as second:
            assert second.acquired
            assert not AdvisoryLock(name, config=transition).acquire()
        with pytest.raises(LockUnavailable, match="not accepted"):
            AdvisoryLock(name, config=old).acquire()
    finally:
        registry.close()


def test_an_old_map_holder_busy_while_finish_drains_is_probed_not_lost(
    three: dict[str, str], two: dict[str, str], run_id: str
) -> None:
    """A busy session is judged by a probe session of its own, which takes no lock: the
    old map refused, the probe still opens (recorded with its map, for finish to wait
    on), and a holder busy in a statement keeps its lock."""
    moving, _ = tenants_of(run_id, two, three)
    name = f"tenant:{moving[0]}"
    old = PglockConfig(shards=parse_shards(two), application_name="pglock-old", check_interval=0.2)
    try:
        assert shards_step(three, two, "begin").startswith("exit 0")
        with AdvisoryLock(name, config=old) as held:
            assert held.acquired
            # finish's first step: the transition alone is accepted; it waits for this.
            assert shards_step(three, two, "finish", "--wait", "0").startswith("exit 1")
            held.connection.execute("SELECT pg_sleep(1.5)")
            assert held.loss is None and held.held()
            dsn = held.config.require_dsn()
            probes = scalar(
                dsn,
                "SELECT count(*) FROM pglock_shard_sessions s JOIN pg_stat_activity a"
                " USING (pid) WHERE a.application_name LIKE 'pglock-old-probe%%'",
            )
            assert probes == 1, "the busy session was not probed: the test proved nothing"
    finally:
        registry.close()


def test_a_step_run_by_a_role_that_cannot_see_every_session_is_refused(
    three: dict[str, str], two: dict[str, str], run_id: str
) -> None:
    """Other roles' sessions show no backend_start to such a role: it could not tell
    their maps, so finish would wait for ever on them. It is told what to grant."""
    role = f"pglock_rollout_{run_id}"
    scalar(three["a"], f"CREATE ROLE {role} LOGIN")
    try:
        as_role = {shard: make_conninfo(dsn, user=role) for shard, dsn in three.items()}
        out = shards_step(as_role, {s: as_role[s] for s in two}, "status", check=False)
        assert out.startswith("exit 2") and "pg_read_all_stats" in out, out
    finally:
        scalar(three["a"], f"DROP ROLE {role}")


def test_the_doctor_says_whether_the_shards_accept_its_map(
    three: dict[str, str], two: dict[str, str]
) -> None:
    def shard_maps(shards: dict[str, str], previous: dict[str, str] | None) -> list[str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PGLOCK_")}
        env["PGLOCK_SHARDS"] = json.dumps(shards)
        env["PGLOCK_SHARDS_PREVIOUS"] = json.dumps(previous) if previous else ""
        done = subprocess.run(
            [sys.executable, "-m", "pglock_celery.cli", "-A", "tests.apps.bare:app",
             "doctor", "--json"],
            env=env, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        found = [f for f in json.loads(done.stdout) if f["check"] == "shard maps"]
        return [f["level"] for f in sorted(found, key=lambda f: f["shard"])]

    assert shard_maps(three, None) == ["ok", "ok", "ok"]  # no record: every map
    assert shards_step(three, two, "begin").startswith("exit 0")
    assert shard_maps(three, two) == ["ok", "ok", "ok"]
    assert shard_maps(three, None) == ["fail", "fail", "fail"]
    assert shard_maps(two, None) == ["ok", "ok"]
