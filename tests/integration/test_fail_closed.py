"""G4: a call that cannot get a lock session never runs its body, and says why."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
import redis
from celery import Celery

from pglock_celery import LockUnavailable, TenantLockedTask
from pglock_celery.sources import registry
from tests.apps import core
from tests.support import netns
from tests.support.locks import eager_app
from tests.support.services import EmbeddedPostgres, wait_until
from tests.support.workers import ROOT, Worker

PASSWORD = "s3cret-pw"
UNREACHABLE = f"postgresql://app:{PASSWORD}@127.0.0.1:1/test"
SUFFIX = "-unreachable"


@pytest.fixture(scope="module")
def blind_worker(app: Celery, worker_env: dict[str, str], log_dir: Path) -> Iterator[Worker]:
    """A worker whose pglock_dsn points at a port where nothing listens."""
    env = {
        **worker_env,
        "PGLOCK_DSN": UNREACHABLE,
        "PGLOCK_TEST_QUEUE": worker_env["PGLOCK_TEST_QUEUE"] + SUFFIX,
    }
    worker = Worker(app, "tests.apps.core", env, log_dir, concurrency=1)
    yield worker
    worker.stop()


def test_unreachable_database_fails_the_call_and_never_runs_the_body(
    blind_worker: Worker, queue: str, broker_url: str, run_id: str
) -> None:
    marker = f"marker:{run_id}"
    call = core.mark.apply_async((run_id, marker), queue=queue + SUFFIX)
    with pytest.raises(LockUnavailable) as raised:
        call.get(timeout=60)
    message = str(raised.value)
    assert "127.0.0.1:1" in message
    assert PASSWORD not in message
    assert redis.Redis.from_url(broker_url).get(marker) is None
    assert PASSWORD not in blind_worker.log.read_text(errors="replace")


def test_autoretry_for_lock_unavailable_retries_then_fails(
    blind_worker: Worker, queue: str, broker_url: str, run_id: str
) -> None:
    marker = f"marker:{run_id}"
    call = core.mark_with_retries.apply_async((run_id, marker), queue=queue + SUFFIX)
    with pytest.raises(LockUnavailable, match=r"127\.0\.0\.1:1"):
        call.get(timeout=60)
    client = redis.Redis.from_url(broker_url)
    assert client.get(f"retries:{call.id}") == b"2"
    assert client.get(marker) is None


# Against the server itself: a standby, a wrong password, no free slots, no answer ---------

SCRAM_PASSWORD = "scram-s3cret"
#: Few slots, none kept for superusers: the test can fill them all.
SLOTS = 8


@pytest.fixture(scope="module")
def scram_primary(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedPostgres]:
    """A throwaway server that wants a password over TCP (SCRAM) and has few slots."""
    server = EmbeddedPostgres(tmp_path_factory.mktemp("scram"))
    server.init(
        f"max_connections = {SLOTS}",
        "superuser_reserved_connections = 0",
        password=SCRAM_PASSWORD,
    )
    server.start()
    yield server
    server.destroy()


def with_password(server: EmbeddedPostgres, password: str = SCRAM_PASSWORD) -> str:
    return f"{server.dsn} password={password}"


def call(dsn: str, tenant: str) -> tuple[bool, BaseException | None]:
    """One TenantLockedTask call against ``dsn``: (whether its body ran, its error)."""
    app = eager_app(dsn, "closed", connect_timeout=2)
    ran: list[str] = []

    @app.task(base=TenantLockedTask, shared=False)
    def step(tenant_id: str) -> str:
        ran.append(tenant_id)
        return "ran"

    result = step.apply((tenant,))
    registry.close()  # a cached session would hold a slot of the server's
    error = result.result if isinstance(result.result, BaseException) else None
    return bool(ran), error


def test_a_standby_is_refused_and_the_body_never_runs(
    scram_primary: EmbeddedPostgres, tmp_path_factory: pytest.TempPathFactory, run_id: str
) -> None:
    standby = scram_primary.standby(tmp_path_factory.mktemp("standby"))
    standby.start()
    try:
        assert standby_answers(standby), "the standby is not in recovery"
        ran, error = call(with_password(standby), run_id)
    finally:
        standby.destroy()
    assert not ran
    assert isinstance(error, LockUnavailable), repr(error)
    assert "read-only" in str(error) or "standby" in str(error), str(error)
    assert SCRAM_PASSWORD not in str(error)


def standby_answers(server: EmbeddedPostgres) -> bool:
    with psycopg.connect(server.socket_dsn) as conn:
        row = conn.execute("SELECT pg_is_in_recovery()").fetchone()
    return bool(row and row[0])


def test_a_wrong_password_is_refused_and_the_body_never_runs(
    scram_primary: EmbeddedPostgres, run_id: str
) -> None:
    ran, error = call(with_password(scram_primary, "not-the-password"), run_id)
    assert not ran
    assert isinstance(error, LockUnavailable), repr(error)
    assert "password authentication failed" in str(error)
    assert "not-the-password" not in str(error)
    assert call(with_password(scram_primary), run_id) == (True, None)  # the right one works


def test_no_free_connection_slot_is_refused_and_the_body_never_runs(
    scram_primary: EmbeddedPostgres, run_id: str
) -> None:
    # Sessions of earlier tests may still be on their way out: fill the slots after.
    wait_until(lambda: other_clients(scram_primary) == 0, 10, "earlier sessions to end")
    taken: list[psycopg.Connection[Any]] = []
    try:
        for _ in range(SLOTS):
            taken.append(psycopg.connect(with_password(scram_primary)))
        with pytest.raises(psycopg.OperationalError, match="too many clients"):
            psycopg.connect(with_password(scram_primary))
        ran, error = call(with_password(scram_primary), run_id)
        assert not ran
        assert isinstance(error, LockUnavailable), repr(error)
        assert "too many clients" in str(error)
        taken.pop().close()
        assert call(with_password(scram_primary), run_id) == (True, None)  # a slot is free
    finally:
        for conn in taken:
            conn.close()


def other_clients(server: EmbeddedPostgres) -> int:
    with psycopg.connect(server.socket_dsn) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity"
            " WHERE backend_type = 'client backend' AND pid <> pg_backend_pid()"
        ).fetchone()
    return int(row[0]) if row else -1


@pytest.fixture
def guest_pg(guest: netns.Guest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A server the guest namespace reaches over the veth pair: its DSN from there."""
    server = EmbeddedPostgres(tmp_path_factory.mktemp("guest-pg"))
    server.init(f"listen_addresses = '127.0.0.1,{netns.HOST_IP}'")
    with (server.data / "pg_hba.conf").open("a") as hba:
        hba.write(f"host all all {netns.GUEST_IP}/32 trust\n")
    server.start()
    yield f"host={netns.HOST_IP} port={server.port} user=postgres dbname=postgres"
    server.destroy()


def attempt_from(guest: netns.Guest, dsn: str, tenant: str) -> dict[str, Any]:
    """One task call made inside the guest namespace (see tests/support/attempt.py)."""
    done = subprocess.run(
        guest.command([sys.executable, "-m", "tests.support.attempt", dsn, tenant]),
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), "PGLOCK_CONNECT_TIMEOUT": "2"},
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)  # type: ignore[no-any-return]


def test_a_host_that_never_answers_times_out_and_the_body_never_runs(
    guest: netns.Guest, guest_pg: str, run_id: str
) -> None:
    """The same server over the same address, once answering and once silent."""
    assert attempt_from(guest, guest_pg, run_id)["ran"] is True
    guest.stop_answering()  # the guest's packets arrive; nothing ever comes back
    outcome = attempt_from(guest, guest_pg, run_id)
    print(f"\nno answer: {outcome['error']} after {outcome['seconds']:.1f} s")
    assert outcome["ran"] is False
    assert outcome["error"] == "LockUnavailable"
    assert "timeout expired" in outcome["message"]
    assert 2 <= outcome["seconds"] < 6  # libpq's connect_timeout, not the kernel's minutes
