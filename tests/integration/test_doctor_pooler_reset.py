"""The doctor tries out whether a session-mode pooler resets a server connection.

Behind a real PgBouncer in session mode whose ``server_reset_query`` is empty, a dead
holder's lock stays on the server connection the pooler keeps, and the next client that
gets it holds it. With ``pglock_pooler = "session"`` the doctor takes a lock and a
setting on one client connection, reconnects until it gets the same server backend,
and fails (with the fix) when either survived.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from pglock_celery import lock_key
from pglock_celery.doctor import Finding, run_checks
from tests.integration.test_cli import cli
from tests.support.pgbouncer import pgbouncer


def reset_finding(findings: list[Finding]) -> Finding:
    (finding,) = [f for f in findings if f.check == "pooler reset"]
    return finding


def advisory_locks(pg_dsn: str) -> int:
    """Advisory locks held in the run's database, seen on the server itself."""
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'"
            " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
        ).fetchone()
    assert row is not None
    return int(row[0])


@pytest.fixture
def no_reset(pg_dsn: str, tmp_path: Path) -> Iterator[str]:
    """A session-mode PgBouncer that hands server connections on without a reset."""
    with pgbouncer(pg_dsn, tmp_path, mode="session", ignore_options=True, reset_query="") as dsn:
        yield dsn


def test_a_session_pooler_without_a_reset_keeps_a_dead_holders_lock(
    no_reset: str, pg_dsn: str
) -> None:
    """What the doctor looks for, shown with a plain holder that goes away."""
    key = lock_key("pooler-reset:dead-holder")
    with psycopg.connect(no_reset, autocommit=True) as holder:
        holder.execute("SELECT pg_advisory_lock(%s)", (key,))
    with psycopg.connect(pg_dsn, autocommit=True) as other:
        assert other.execute("SELECT pg_try_advisory_lock(%s)", (key,)).fetchone() == (False,)
    findings = run_checks(no_reset, pooler="session")
    # The next client handed that server connection holds the dead holder's lock: free it.
    with psycopg.connect(no_reset, autocommit=True) as next_client:
        next_client.execute("SELECT pg_advisory_unlock_all()")
    assert reset_finding(findings).level == "fail"


def test_the_doctor_fails_behind_a_session_pooler_that_does_not_reset(
    no_reset: str, pg_dsn: str
) -> None:
    findings = run_checks(no_reset, pooler="session")
    finding = reset_finding(findings)
    assert finding.level == "fail", finding
    assert "still on it" in finding.message and "keeps its locks" in finding.message
    assert "server_reset_query = DISCARD ALL" in finding.fix
    assert [f.level for f in findings if f.check == "lock session"] == ["ok"]
    assert advisory_locks(pg_dsn) == 0  # the probe released its own lock


def test_the_doctor_command_reads_pglock_pooler_and_exits_1_with_the_fix(
    no_reset: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PGLOCK_POOLER", "session")
    done = cli("doctor", dsn=no_reset)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "[FAIL] pooler reset" in done.stdout
    assert "fix: PgBouncer: server_reset_query = DISCARD ALL" in done.stdout


def test_the_doctor_passes_behind_a_session_pooler_that_discards_all(
    pg_dsn: str, tmp_path: Path
) -> None:
    with pgbouncer(pg_dsn, tmp_path, mode="session", ignore_options=True) as through:
        findings = run_checks(through, pooler="session")
    assert reset_finding(findings).level == "ok", reset_finding(findings)
    assert [f.level for f in findings if f.check == "lock session"] == ["ok"]
    assert advisory_locks(pg_dsn) == 0


def test_without_a_session_pooler_the_probe_does_not_run(pg_dsn: str) -> None:
    assert not [f for f in run_checks(pg_dsn) if f.check == "pooler reset"]
