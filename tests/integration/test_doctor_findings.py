"""The doctor reports what it finds as findings, named for what is wrong, against real servers.

An invalid pglock setting is a ``[FAIL]`` finding (exit 1) among the others, not a stop
with exit 2; ``pglock_pooler = "session"`` behind a real transaction-mode PgBouncer names
that pooler (instead of dying on a prepared statement of another client, or leaving its
probe's lock on a pooled backend); and over a Unix socket, where TCP keepalives do not
apply, the keepalive finding says what bounds a cut-off client instead of "in 0 s".
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from pglock_celery.doctor import Finding, run_checks
from tests.support.cli import cli
from tests.support.pgbouncer import pgbouncer
from tests.support.services import over_unix_socket


def finding(findings: list[Finding], check: str) -> Finding:
    (found,) = [f for f in findings if f.check == check]
    return found


def advisory_locks(pg_dsn: str) -> int:
    """Advisory locks held in the run's database, seen on the server itself."""
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'"
            " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
        ).fetchone()
    assert row is not None
    return int(row[0])


@pytest.mark.parametrize(
    ("variable", "value", "named"),
    [
        ("PGLOCK_STRATEGY", "pooled", "PGLOCK_STRATEGY='pooled': must be 'connect', 'reuse'"),
        ("PGLOCK_POOLER", "sesion", "PGLOCK_POOLER='sesion': must be 'none' or 'session'"),
    ],
)
def test_an_invalid_setting_is_a_fail_finding_and_exit_1_with_every_other_check(
    pg_dsn: str, monkeypatch: pytest.MonkeyPatch, variable: str, value: str, named: str
) -> None:
    monkeypatch.setenv(variable, value)
    done = cli("doctor", dsn=pg_dsn)
    print("\n" + done.stdout)
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"[FAIL] settings: invalid setting {named}" in done.stdout
    assert "[ok]   version: PostgreSQL" in done.stdout  # the other checks ran all the same
    assert "1 problem(s) found" in done.stdout
    assert done.stderr == ""


def test_an_invalid_setting_is_a_finding_in_the_json_output(
    pg_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PGLOCK_ON_LOST", "kill")
    done = cli("doctor", "--json", dsn=pg_dsn)
    assert done.returncode == 1, done.stdout + done.stderr
    assert '"check": "settings"' in done.stdout and "PGLOCK_ON_LOST='kill'" in done.stdout


@pytest.fixture
def transaction_pooler(pg_dsn: str, tmp_path: Path) -> Iterator[str]:
    """A transaction-mode PgBouncer that drops startup options silently (a common setup)."""
    with pgbouncer(pg_dsn, tmp_path, mode="transaction", ignore_options=True) as dsn:
        yield dsn


def test_a_session_pooler_setting_behind_a_transaction_pooler_names_the_pooler(
    transaction_pooler: str, pg_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Run twice: the second run once died on `prepared statement "_pg3_0" already exists`."""
    monkeypatch.setenv("PGLOCK_POOLER", "session")
    for _ in range(2):
        done = cli("doctor", dsn=transaction_pooler)
        print("\n" + done.stdout)
        assert done.returncode == 1, done.stdout + done.stderr
        assert "[FAIL] pooler: pglock_pooler = 'session', but the pooler" in done.stdout
        assert "is in transaction mode" in done.stdout
        assert "fix: PgBouncer: pool_mode = session" in done.stdout
        assert "prepared statement" not in done.stdout + done.stderr
        # The session probes are not run through it: no misleading verdict of theirs.
        assert "] pooler reset:" not in done.stdout and "] lock session:" not in done.stdout
    assert advisory_locks(pg_dsn) == 0  # no probe lock left on a pooled backend


def test_keepalives_over_a_unix_socket_say_they_do_not_apply(pg_dsn: str) -> None:
    findings = run_checks(over_unix_socket(pg_dsn))
    keepalives = finding(findings, "keepalives")
    assert keepalives.level == "ok", keepalives
    assert "TCP keepalives do not apply" in keepalives.message
    assert "frees its locks at once" in keepalives.message
    assert finding(findings, "lock session").level == "ok"


def test_keepalives_through_a_pooler_on_a_unix_socket_name_the_pooler_not_0_s(
    pg_dsn: str, tmp_path: Path
) -> None:
    """A client over TCP to PgBouncer, PgBouncer over the server's Unix socket."""
    with pgbouncer(
        over_unix_socket(pg_dsn), tmp_path, mode="session", ignore_options=True
    ) as through:
        findings = run_checks(through, pooler="session")
    keepalives = finding(findings, "keepalives")
    assert keepalives.level == "warn", keepalives
    assert "0 s" not in keepalives.message
    assert "the server sees a Unix socket" in keepalives.message
    assert "tcp_keepidle" in keepalives.fix
    # Its tcp_keepalives_idle shows 0 there: not a lock session setting that "did not take".
    assert finding(findings, "lock session").level == "ok", finding(findings, "lock session")
