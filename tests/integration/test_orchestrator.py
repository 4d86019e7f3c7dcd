"""The orchestrator end to end: replicas, beat, a fast clock, real services."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg
import pytest

from pglock_celery import lock_key
from pglock_celery.config import PglockConfig
from pglock_celery.inspect import list_holders
from pglock_celery.shards import parse_shards
from pglock_celery.sources import registry
from tasks import training
from tasks.celery_app import app as tasks_app
from tasks.pipeline import advance_pipeline
from tasks.schema import apply_schema
from tasks.tenants import ONBOARDING_LOCK, TenantError, onboard_tenant, seed_tenants
from tests.support.orchestra import Orchestra
from tests.support.services import own_database, wait_until

Factory = Callable[..., Orchestra]


@pytest.fixture
def orchestra(pg_dsn: str, broker_url: str, log_dir: Path) -> Iterator[Factory]:
    made: list[Orchestra] = []

    def make(**clock: str) -> Orchestra:
        made.append(Orchestra(pg_dsn, broker_url, log_dir, tasks_app, **clock))
        return made[-1]

    yield make
    for orchestra in made:
        orchestra.close()


def wait_for_cycles(orc: Orchestra, cycles: int, timeout: float) -> None:
    try:
        wait_until(
            lambda: min(orc.cycles().values()) >= cycles, timeout, f"{cycles} cycles each", 0.5
        )
    except AssertionError:
        raise AssertionError(f"cycles {orc.cycles()}\n{orc.logs()}") from None


def assert_clean(orc: Orchestra) -> None:
    summary = orc.summary()
    print("\n" + "\n".join(summary.lines()))
    assert summary.overlaps == 0
    assert summary.duplicate_jobs == 0
    assert summary.repeated_submits == 0
    assert summary.stopped == 0
    with orc.connect() as conn:
        # Exactly one training job per run each tenant started.
        mismatched = conn.execute(
            "SELECT p.tenant_id FROM pipelines p"
            " LEFT JOIN training_jobs j USING (tenant_id)"
            " GROUP BY p.tenant_id, p.run_number HAVING count(j.job_id) <> p.run_number"
        ).fetchall()
    assert mismatched == []


#: As a real fleet meets: a download outlasts the scan interval, so the next scan sends
#: the tenant again while its step runs, and that copy finds the tenant locked.
CONTENDED = {"ORCH_DOWNLOAD_SECONDS": "1.5"}


def test_three_replicas_and_beat_drive_ten_tenants_through_two_cycles(orchestra: Factory) -> None:
    orc = orchestra(**CONTENDED)
    orc.seed(10)
    orc.replicas(3)
    orc.beat()
    wait_for_cycles(orc, 2, 120)
    assert_clean(orc)
    assert_replicas_competed(orc)


def test_two_beats_at_once_cost_only_skips(orchestra: Factory) -> None:
    orc = orchestra(**CONTENDED)
    orc.seed(10)
    orc.replicas(3)
    orc.beat()
    orc.beat()
    wait_for_cycles(orc, 2, 120)
    assert_clean(orc)
    assert_replicas_competed(orc)


def assert_replicas_competed(orc: Orchestra) -> None:
    """0 overlaps means something only if replicas met on a tenant: skips, shared tenants."""
    skips, contended = orc.skips(), orc.contended_tenants()
    print(f"\n{skips} skips; {contended} tenants ran steps on more than one replica")
    assert skips > 0, "no step ever found its tenant locked: 0 overlaps proves nothing"
    assert contended > 0, "no tenant ever moved between replicas"


def test_a_replica_killed_mid_step_hands_its_tenant_to_the_others(orchestra: Factory) -> None:
    orc = orchestra(ORCH_STEP_SECONDS="1")
    orc.seed(4)
    replicas = orc.replicas(3)
    orc.beat()
    with orc.connect() as conn:
        holder = wait_until(
            lambda: next(
                (h for h in list_holders(conn) if h.name and h.name.startswith("training:")), None
            ),
            60,
            "a step to hold its tenant's lock",
        )
        victim = next(r for r in replicas if holder.worker_pid in r.tree())
        tenant = holder.name.removeprefix("training:")  # type: ignore[union-attr]
        victim.kill()
        killed_at = conn.execute("SELECT clock_timestamp()").fetchone()[0]  # type: ignore[index]
        next_start = wait_until(
            lambda: conn.execute(
                "SELECT min(started_at) FROM step_history WHERE tenant_id = %s AND started_at > %s",
                (tenant, killed_at),
            ).fetchone()[0],  # type: ignore[index]
            30,
            f"{tenant} to run again",
            0.1,
        )
    delay = (next_start - killed_at).total_seconds()
    print(f"\nreplica {victim.name} killed mid-step; {tenant} ran again after {delay:.2f} s")
    assert delay <= 1.0 + 1.0  # one scan interval, plus the time to deliver the step
    wait_for_cycles(orc, 1, 60)
    assert_clean(orc)


def test_concurrent_onboarding_runs_one_tenant_at_a_time(orchestra: Factory) -> None:
    orc = orchestra(ORCH_STEP_SECONDS="0.3")
    orc.replicas(3)
    calls = [onboard_tenant.delay(f"new-{n}") for n in range(5)]
    assert sorted(call.get(timeout=60) for call in calls) == [f"new-{n}" for n in range(5)]
    with orc.connect() as conn:
        rows = conn.execute(
            "SELECT started_at, finished_at, worker_pid FROM onboarding_history ORDER BY started_at"
        ).fetchall()
    assert len(rows) == 5
    assert len({pid for _, _, pid in rows}) > 1, "one process did every onboarding"
    for (_, end, _), (start, _, _) in itertools.pairwise(rows):
        assert start >= end, "two onboardings overlapped"


def test_bad_tenant_ids_are_refused_and_change_nothing(orchestra: Factory) -> None:
    orc = orchestra()
    orc.seed(1)
    for bad, why in [("", "empty"), ("x" * 65, "limit is 64"), ("tenant-001", "already exists")]:
        with pytest.raises(TenantError, match=why):
            seed_tenants(orc.dsn, ["fresh-one", bad])
    with orc.connect() as conn:
        assert conn.execute("SELECT tenant_id FROM tenants").fetchall() == [("tenant-001",)]
        assert conn.execute("SELECT count(*) FROM pipelines").fetchone() == (1,)


def test_unknown_tenant_step_fails_clearly_without_training(orchestra: Factory) -> None:
    orc = orchestra()
    orc.replicas(1)
    with pytest.raises(LookupError, match="no tenant 'ghost'"):
        advance_pipeline.delay("ghost").get(timeout=60)
    with pytest.raises(TenantError, match="empty"):
        onboard_tenant.delay("").get(timeout=60)
    with orc.connect() as conn:
        assert conn.execute("SELECT count(*) FROM training_jobs").fetchone() == (0,)
        assert conn.execute("SELECT count(*) FROM tenants").fetchone() == (0,)


def test_corrupted_pipeline_row_stops_that_tenant_and_the_others_go_on(
    orchestra: Factory,
) -> None:
    orc = orchestra()
    orc.seed(3)
    with orc.connect() as conn:
        # An operator's hand edit: pipelines is a guarded table, so it turns the guard off.
        conn.execute("SET pglock.guard = off")
        conn.execute("UPDATE pipelines SET stage = 'bogus' WHERE tenant_id = 'tenant-002'")
    orc.replicas(2)
    orc.beat()
    wait_until(
        lambda: all(c >= 1 for t, c in orc.cycles().items() if t != "tenant-002"), 60, "cycles"
    )
    with orc.connect() as conn:
        stage, error = conn.execute(
            "SELECT stage, last_error FROM pipelines WHERE tenant_id = 'tenant-002'"
        ).fetchone()  # type: ignore[misc]
    assert stage == "stopped"
    assert "unknown stage 'bogus'" in error


@pytest.fixture
def three_shards(pg_server: str) -> Iterator[dict[str, str]]:
    """The `tasks` app over three databases of the test's own, each with the orchestrator's
    schema: yields shard name -> DSN; the app's settings are put back afterwards."""
    saved = {key: tasks_app.conf.get(key) for key in ("pglock_dsn", "pglock_shards")}
    with contextlib.ExitStack() as stack:
        shards = {f"s{n}": stack.enter_context(own_database(pg_server)) for n in (1, 2, 3)}
        for dsn in shards.values():
            apply_schema(dsn)
        tasks_app.conf.update(pglock_dsn=None, pglock_shards=shards)
        try:
            yield shards
        finally:
            tasks_app.conf.update(saved)
            registry.close()  # this process's idle sessions, before their databases go


def test_over_shards_each_tenant_is_seeded_onboarded_and_stepped_on_its_locks_shard(
    three_shards: dict[str, str],
) -> None:
    """Seeding, onboarding and a first step put a tenant's rows (tenant, pipeline, step,
    training job) in the database of its lock's shard, and in no other."""
    seeded = [f"tenant-{n:03d}" for n in range(1, 10)]
    onboarded = [f"new-{n}" for n in range(1, 10)]
    seed_tenants(None, seeded)
    for tenant in onboarded:
        assert onboard_tenant.apply((tenant,)).get() == tenant
    for tenant in seeded + onboarded:
        assert advance_pipeline.apply((tenant,)).get()["outcome"] == "submitted"
    placement = PglockConfig(shards=parse_shards(three_shards))

    def shard_of(name: str) -> str:
        return placement.shard_of(lock_key(name), name)

    for shard, dsn in three_shards.items():
        mine = sorted(t for t in seeded + onboarded if shard_of(f"training:{t}") == shard)
        assert mine, f"no tenant on shard {shard}: the test would prove little"
        with psycopg.connect(dsn) as conn:
            for table in ("tenants", "pipelines", "step_history", "training_jobs"):
                rows = conn.execute(f"SELECT tenant_id FROM {table} ORDER BY 1").fetchall()
                assert [tenant for (tenant,) in rows] == mine, (shard, table)
            onboardings = conn.execute("SELECT count(*) FROM onboarding_history").fetchone()
        # An onboarding is recorded where its lock lives, whichever shard its tenant is on.
        expected = len(onboarded) if shard == shard_of(ONBOARDING_LOCK) else 0
        assert onboardings == (expected,), shard


def test_a_training_connection_left_mid_statement_is_not_used_again(pg_dsn: str) -> None:
    """A step interrupted by LockLost while it waited on the training service's connection
    leaves that connection in the middle of its statement: the next call opens another
    instead of failing with "another command is already in progress"."""
    first = training._conn(pg_dsn)
    first.pgconn.send_query(b"SELECT pg_sleep(0.01)")  # as a statement cut short leaves it
    assert first.info.transaction_status == psycopg.pq.TransactionStatus.ACTIVE
    again = training._conn(pg_dsn)
    assert again is not first and first.closed
    assert again.execute("SELECT 1").fetchone() == (1,)
