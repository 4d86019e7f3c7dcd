"""The README's migration recipes against real Postgres and workers, and the doctor's fixes."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import psycopg
import pytest

from pglock_celery import TenantLockedTask, lock_key, try_lock
from pglock_celery.doctor import run_checks
from tasks.services import postgres_bindir
from tests.apps import core
from tests.support.history import read_history
from tests.support.locks import free_elsewhere
from tests.support.services import EmbeddedPostgres, wait_until
from tests.support.workers import Worker
from tests.unit.test_migration_recipes import recipe


def hand_rolled_key(name: str) -> int:
    """The original write-up's formula, as its users wrote it."""
    import hashlib

    return int(hashlib.md5(name.encode()).hexdigest()[:16], 16) - (2**63 - 1)


def test_duplicates_are_sent_queue_and_skip_while_the_first_holds(
    workers: list[Worker], history: str, pg_dsn: str, run_id: str
) -> None:
    """No AlreadyQueued at send: every copy is sent, runs, and reports the skip."""
    ran = recipe("skipped")["ran"]
    tenant = f"{run_id}-dup"
    with try_lock(f"tenant:{tenant}", dsn=pg_dsn) as held:
        assert held.acquired
        copies = [core.step.delay(tenant, history) for _ in range(5)]
        results = [copy.get(timeout=60) for copy in copies]
    assert len({copy.id for copy in copies}) == 5
    assert [ran(result) for result in results] == [False] * 5
    assert ran(core.step.delay(tenant, history).get(timeout=60))
    assert len(read_history(pg_dsn, history)) == 1


def test_a_hung_holder_is_freed_by_its_hard_time_limit_not_a_ttl(
    workers: list[Worker], history: str, pg_dsn: str, run_id: str
) -> None:
    """core.stuck sleeps 30 s under time_limit=1: the pool kills it, Postgres frees the lock."""
    name = f"tenant:{run_id}-hung"
    core.stuck.delay(f"{run_id}-hung", history)
    wait_until(lambda: read_history(pg_dsn, history), 30, "the hung step to start")
    started = time.monotonic()
    with try_lock(name, dsn=pg_dsn) as early:
        assert not early.acquired, "the lock must be held while the step runs"

    wait_until(
        lambda: free_elsewhere(pg_dsn, name), 10, "the hard time limit to free the lock", 0.1
    )
    freed = time.monotonic() - started
    print(f"\nhung holder's lock freed {freed:.2f} s after it was seen holding it")
    assert freed < 5


@pytest.mark.parametrize("peer", ["pals", "django-pglock session", "django-pglock xact"])
def test_a_peers_key_taken_by_number_excludes_in_a_mixed_fleet(
    pg_dsn: str, run_id: str, peer: str
) -> None:
    keys = recipe("keys")
    name = f"account-{run_id}"
    key = keys["pals_key"]("billing", name) if peer == "pals" else keys["django_pglock_key"](name)
    with psycopg.connect(pg_dsn, autocommit=True) as theirs:
        if peer.endswith("xact"):
            theirs.execute("BEGIN")
            taken = theirs.execute("SELECT pg_try_advisory_xact_lock(%s)", (key,)).fetchone()
        else:
            taken = theirs.execute("SELECT pg_try_advisory_lock(%s)", (key,)).fetchone()
        assert taken == (True,)
        with try_lock(key, dsn=pg_dsn) as ours:
            assert not ours.acquired
        theirs.execute("ROLLBACK" if peer.endswith("xact") else "SELECT pg_advisory_unlock_all()")
    with try_lock(key, dsn=pg_dsn) as ours:
        assert ours.acquired
        with psycopg.connect(pg_dsn, autocommit=True) as theirs:
            taken = theirs.execute("SELECT pg_try_advisory_lock(%s)", (key,)).fetchone()
            assert taken == (False,)


def test_hand_rolled_replicas_and_tenant_locked_task_exclude_each_other(
    app: object, pg_dsn: str, history: str, run_id: str
) -> None:
    tenant = f"{run_id}-mixed"
    key = hand_rolled_key(f"tenant:{tenant}")
    assert key == lock_key(f"tenant:{tenant}")
    with psycopg.connect(pg_dsn, autocommit=True) as old_replica:
        assert old_replica.execute("SELECT pg_try_advisory_lock(%s)", (key,)).fetchone() == (True,)
        result = core.step.apply(args=(tenant, history)).get()
        assert result["skipped"] is True and result["lock"] == f"tenant:{tenant}"
        old_replica.execute("SELECT pg_advisory_unlock(%s)", (key,))
    with try_lock(f"tenant:{tenant}", dsn=pg_dsn) as new_replica:
        assert new_replica.acquired
        with psycopg.connect(pg_dsn, autocommit=True) as old_replica:
            taken = old_replica.execute("SELECT pg_try_advisory_lock(%s)", (key,)).fetchone()
            assert taken == (False,)


def test_options_of_other_lock_libraries_are_not_ignored_silently(app: object) -> None:
    from tests.apps.core import app as core_app

    with pytest.warns(Warning, match="lock_expiry"):

        @core_app.task(base=TenantLockedTask, lock_expiry=600, shared=False)
        def migrated(tenant_id: str) -> None: ...

        assert migrated.name


def psql_script(dsn: str, script: str) -> subprocess.CompletedProcess[str]:
    """Paste ``script`` into psql, as an operator would (one statement at a time)."""
    return subprocess.run(
        [str(postgres_bindir() / "psql"), "-X", "-v", "ON_ERROR_STOP=1", dsn],
        input=script, capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def test_the_doctors_keepalive_fix_pastes_into_psql_and_clears_the_warning(
    tmp_path: Path,
) -> None:
    server = EmbeddedPostgres(tmp_path / "pg")
    server.init()
    server.start()
    try:
        before = {f.check: f for f in run_checks(server.dsn)}
        assert before["keepalives"].level == "warn", before["keepalives"]
        pasted = psql_script(server.dsn, before["keepalives"].fix + "\n")
        assert pasted.returncode == 0, pasted.stderr
        after = {f.check: f for f in run_checks(server.dsn)}
        assert after["keepalives"].level == "ok", after["keepalives"]
    finally:
        server.destroy()
