"""The pglock-celery command against real servers and real workers."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from pglock_celery import lock_key, try_lock
from tests.apps import core
from tests.support.cli import cli
from tests.support.history import Run, read_history
from tests.support.pgbouncer import pgbouncer
from tests.support.services import EmbeddedPostgres, wait_until
from tests.support.workers import Worker

PASSWORD = "cli-s3cret"


def test_key_prints_the_seed_compatible_key() -> None:
    done = cli("key", "tenant:42")
    assert done.returncode == 0
    assert done.stdout.strip() == str(lock_key("tenant:42")) == "-8502700072172048958"


def test_locks_lists_real_holders_with_name_key_task_and_pid(
    workers: list[Worker], history: str, pg_dsn: str, run_id: str
) -> None:
    short = f"{run_id}-cli"
    long = f"{run_id}-" + "x" * 60  # its application_name is cut at 63 bytes
    release = f"cli-release-{run_id}"
    calls = {tenant: core.hold_until.delay(tenant, history, release) for tenant in (short, long)}

    def both_started() -> list[Run] | None:
        rows = read_history(pg_dsn, history)
        return rows if len(rows) == 2 else None

    runs = wait_until(both_started, 30, "both steps to hold their locks")
    pids = {run.lock_name: run.worker_pid for run in runs}
    with try_lock(-12345, dsn=pg_dsn) as negative:
        assert negative.acquired
        done = cli("locks", "--json", dsn=pg_dsn)
        table = cli("locks", "--prefix", f"tenant:{run_id}", dsn=pg_dsn)
    assert done.returncode == 0, done.stderr
    by_key = {row["key"]: row for row in json.loads(done.stdout)}
    whole = by_key[lock_key(f"tenant:{short}")]
    assert whole["name"] == f"tenant:{short}" and not whole["name_truncated"]
    assert whole["task_id"] == calls[short].id
    assert whole["worker_pid"] == pids[f"tenant:{short}"]
    cut = by_key[lock_key(f"tenant:{long}")]
    assert cut["name_truncated"] and f"tenant:{long}".startswith(cut["name"])
    assert by_key[-12345]["name"] is None
    print("\n" + table.stdout)
    assert f"tenant:{short}" in table.stdout and "…" in table.stdout
    assert "-12345" not in table.stdout  # filtered out by --prefix
    core._marker().set(release, "go", ex=300)  # the steps hold until now, however slow
    for call in calls.values():
        assert call.get(timeout=30)["ran"]


def test_doctor_passes_on_the_local_server(pg_dsn: str) -> None:
    done = cli("doctor", dsn=pg_dsn)
    print("\n" + done.stdout)
    assert done.returncode == 0, done.stdout
    assert "[FAIL]" not in done.stdout


@pytest.fixture
def role_with_idle_timeout(pg_dsn: str, run_id: str) -> Iterator[str]:
    role = f"pglock_idle_{run_id}"
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(f"CREATE ROLE {role} LOGIN")
        conn.execute(f"ALTER ROLE {role} SET idle_session_timeout = '30s'")
    params = psycopg.conninfo.conninfo_to_dict(pg_dsn)
    yield psycopg.conninfo.make_conninfo(**{**params, "user": role})  # type: ignore[arg-type]
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(f"DROP ROLE {role}")


def test_doctor_fails_on_idle_session_timeout_for_the_role(role_with_idle_timeout: str) -> None:
    done = cli("doctor", dsn=role_with_idle_timeout)
    print("\n" + done.stdout)
    assert done.returncode == 1
    assert "[FAIL] idle_session_timeout: idle_session_timeout = 30s" in done.stdout


@pytest.fixture(scope="module")
def primary(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedPostgres]:
    """A throwaway server that wants a password over TCP."""
    server = EmbeddedPostgres(tmp_path_factory.mktemp("primary"))
    server.init(password=PASSWORD)
    server.start()
    yield server
    server.destroy()


def test_doctor_fails_on_a_standby(
    primary: EmbeddedPostgres, tmp_path_factory: pytest.TempPathFactory
) -> None:
    standby = primary.standby(tmp_path_factory.mktemp("standby"))
    standby.start()
    try:
        done = cli("doctor", dsn=f"{standby.dsn} password={PASSWORD}")
    finally:
        standby.destroy()
    print("\n" + done.stdout)
    assert done.returncode == 1
    assert "[FAIL] standby" in done.stdout
    assert PASSWORD not in done.stdout + done.stderr


@pytest.mark.parametrize(
    ("dsn", "expected"),
    [
        (f"postgresql://app:{PASSWORD}@127.0.0.1:1/db", "cannot connect to 127.0.0.1:1/db"),
        (f"host=127.0.0.1 password={PASSWORD} oops", "malformed DSN"),
    ],
)
def test_bad_dsns_give_one_line_and_exit_2(dsn: str, expected: str) -> None:
    for command in ("locks", "doctor"):
        done = cli(command, "--dsn", dsn)
        assert done.returncode == 2
        assert expected in done.stderr
        assert len(done.stderr.strip().splitlines()) == 1
        assert "Traceback" not in done.stderr
        assert PASSWORD not in done.stdout + done.stderr


def test_a_wrong_password_gives_one_line_and_exit_2(primary: EmbeddedPostgres) -> None:
    done = cli("locks", "--dsn", f"{primary.dsn} password=not-{PASSWORD}")
    assert done.returncode == 2
    assert "password authentication failed" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    assert f"not-{PASSWORD}" not in done.stderr
    # and the right one works: the server really checks passwords
    assert cli("locks", "--dsn", f"{primary.dsn} password={PASSWORD}").returncode == 0


def test_missing_dsn_is_a_usage_error() -> None:
    done = cli("locks")
    assert done.returncode == 2 and "PGLOCK_DSN" in done.stderr


@pytest.fixture
def transaction_pooler(pg_dsn: str, tmp_path: Path) -> Iterator[str]:
    """PgBouncer in transaction mode in front of the test server."""
    with pgbouncer(pg_dsn, tmp_path, mode="transaction") as dsn:
        yield dsn


def test_doctor_fails_behind_a_transaction_pooler(transaction_pooler: str) -> None:
    done = cli("doctor", dsn=transaction_pooler)
    print("\n" + done.stdout)
    assert done.returncode == 1
    assert "[FAIL] pooler" in done.stdout
    assert "[FAIL] lock session" in done.stdout  # it also refuses the session settings
