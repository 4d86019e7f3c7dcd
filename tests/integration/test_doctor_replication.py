"""The doctor fails on a primary with replicas that commits asynchronously (G12).

A real primary with a real streaming standby, both the test's own: asynchronous
(synchronous_standby_names empty) fails, synchronous passes, and synchronous_commit =
local for the lock role fails again.
"""

from __future__ import annotations

from collections.abc import Iterator

import psycopg
import pytest

from pglock_celery.doctor import Finding, run_checks
from tests.integration.test_cli import cli
from tests.support.services import EmbeddedPostgres, wait_until


def replication(dsn: str) -> Finding:
    (finding,) = [f for f in run_checks(dsn) if f.check == "replication"]
    return finding


def admin(server: EmbeddedPostgres, statement: str) -> None:
    with psycopg.connect(server.socket_dsn, autocommit=True) as conn:
        conn.execute(statement)


def sync_standbys(server: EmbeddedPostgres) -> int:
    with psycopg.connect(server.socket_dsn) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_replication WHERE sync_state = 'sync'"
        ).fetchone()
    return int(row[0]) if row else 0


def streaming(server: EmbeddedPostgres) -> int:
    with psycopg.connect(server.socket_dsn) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_replication WHERE state = 'streaming'"
        ).fetchone()
    return int(row[0]) if row else 0


@pytest.fixture(scope="module")
def primary(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedPostgres]:
    """A primary streaming to a standby of its own."""
    server = EmbeddedPostgres(tmp_path_factory.mktemp("repl-primary"))
    server.init()
    server.start()
    standby = None
    try:
        standby = server.standby(tmp_path_factory.mktemp("repl-standby"))
        standby.start()
        wait_until(lambda: streaming(server) == 1, 30, "the standby to stream")
        yield server
    finally:
        if standby is not None:
            standby.destroy()
        server.destroy()


def test_a_primary_without_replicas_is_fine(pg_dsn: str) -> None:
    with psycopg.connect(pg_dsn) as conn:
        row = conn.execute("SELECT count(*) FROM pg_stat_replication").fetchone()
    if row != (0,):
        pytest.fail("the run's server has replicas: this test needs one without")
    assert replication(pg_dsn).level == "ok"


def test_asynchronous_replicas_fail_synchronous_pass_and_a_local_commit_role_fails(
    primary: EmbeddedPostgres,
) -> None:
    finding = replication(primary.dsn)
    assert finding.level == "fail", finding
    assert "1 streaming replica(s), but commits are asynchronous" in finding.message
    assert "synchronous_mode: true and synchronous_mode_strict: true" in finding.fix
    done = cli("doctor", dsn=primary.dsn)
    assert done.returncode == 1 and "[FAIL] replication" in done.stdout

    admin(primary, "ALTER SYSTEM SET synchronous_standby_names = '*'")
    primary.reload()  # its files reachable first (a pytest process may close them)
    wait_until(lambda: sync_standbys(primary) == 1, 30, "the standby to be synchronous")
    finding = replication(primary.dsn)
    assert finding.level == "ok", finding
    assert "commits wait for a synchronous standby (*, synchronous_commit = on)" in (
        finding.message
    )

    admin(primary, "ALTER ROLE postgres SET synchronous_commit = local")
    try:
        finding = replication(primary.dsn)
    finally:
        admin(primary, "ALTER ROLE postgres RESET synchronous_commit")
    assert finding.level == "fail", finding
    assert "synchronous_commit = local for this role" in finding.message
    assert "ALTER ROLE <lock role> SET synchronous_commit = on" in finding.fix
