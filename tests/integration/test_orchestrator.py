"""The orchestrator end to end: replicas, beat, a fast clock, real services."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from pglock_celery.inspect import list_holders
from tasks.celery_app import app as tasks_app
from tasks.pipeline import advance_pipeline
from tasks.tenants import TenantError, onboard_tenant, seed_tenants
from tests.support.orchestra import Orchestra
from tests.support.services import wait_until

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
