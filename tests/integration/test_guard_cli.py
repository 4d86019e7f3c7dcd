"""`pglock-celery guard install|remove|list`, and the doctor on guarded tables."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator

import psycopg
import pytest

from pglock_celery.doctor import run_checks
from tests.support.cli import cli


@pytest.fixture
def table(pg_dsn: str) -> Iterator[str]:
    schema = f"guard_cli_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {schema}")
        conn.execute(f"CREATE TABLE {schema}.jobs (tenant_id text, n int)")
    yield f"{schema}.jobs"
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(f"DROP SCHEMA {schema} CASCADE")


def listed(pg_dsn: str) -> dict[str, dict[str, object]]:
    done = cli("guard", "list", "--json", dsn=pg_dsn)
    assert done.returncode == 0, done.stderr
    return {row["table"]: row for row in json.loads(done.stdout)}


def test_install_list_remove_round_trip(pg_dsn: str, table: str) -> None:
    done = cli("guard", "install", table, "--lock", "jobs:{tenant_id}", "--dsn", pg_dsn)
    assert done.returncode == 0, done.stderr
    assert (
        done.stdout.strip()
        == f"guarded {table}: a write to a row needs the lock jobs:{{tenant_id}}"
    )
    assert listed(pg_dsn)[table]["lock_name"] == "jobs:{tenant_id}"
    assert listed(pg_dsn)[table]["state"] == "on"
    again = cli("guard", "install", table, "--lock", "jobs:{tenant_id}", dsn=pg_dsn)
    assert again.returncode == 0, again.stderr
    shown = cli("guard", "list", dsn=pg_dsn).stdout
    assert any(line.split() == [table, "jobs:{tenant_id}", "on"] for line in shown.splitlines())
    with psycopg.connect(pg_dsn, autocommit=True) as conn, pytest.raises(psycopg.Error):
        conn.execute(f"INSERT INTO {table} VALUES ('t1', 0)")
    removed = cli("guard", "remove", table, dsn=pg_dsn)
    assert removed.returncode == 0, removed.stderr
    assert removed.stdout.strip() == (
        f"removed the guard (lock jobs:{{tenant_id}}) of {table}: writes need no lock"
    )
    assert table not in listed(pg_dsn)
    again = cli("guard", "remove", table, dsn=pg_dsn)
    assert again.returncode == 0, again.stderr
    assert again.stdout.strip() == f"{table} had no guard: nothing removed"
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(f"INSERT INTO {table} VALUES ('t1', 0)")


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (("install", "{table}", "--lock", "jobs:{{tenant}}"), "not a column"),
        (("install", "{table}", "--lock", "jobs:{{tenant_id!r}}"), "conversion or format spec"),
        (("install", "{table}_missing", "--lock", "jobs:{{tenant_id}}"), "no table"),
        (("remove", "{table}_missing"), "no table"),
        (("install", "a.b.c.d", "--lock", "x"), "not a table name"),
    ],
)
def test_bad_input_is_one_line_and_exit_2_before_anything_changes(
    pg_dsn: str, table: str, args: tuple[str, ...], says: str
) -> None:
    done = cli("guard", *(arg.format(table=table) for arg in args), dsn=pg_dsn)
    assert done.returncode == 2
    assert done.stdout == ""
    assert len(done.stderr.strip().splitlines()) == 1
    assert done.stderr.startswith("pglock-celery: error: ") and says in done.stderr
    assert table not in listed(pg_dsn)


def test_an_unreachable_database_is_exit_2_without_the_password() -> None:
    done = cli("guard", "list", "--dsn", "postgresql://app:s3cret-pw@127.0.0.1:1/db")
    assert done.returncode == 2
    assert "cannot connect" in done.stderr and "s3cret-pw" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_doctor_lists_guarded_tables_and_fails_on_a_disabled_guard(pg_dsn: str, table: str) -> None:
    assert cli("guard", "install", table, "--lock", "jobs:{tenant_id}", dsn=pg_dsn).returncode == 0
    mine = [f for f in run_checks(pg_dsn) if f.check == "guarded table" and table in f.message]
    assert [(f.level, f.message) for f in mine] == [("ok", f"{table}: lock jobs:{{tenant_id}}")]
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(f"ALTER TABLE {table} DISABLE TRIGGER zz_pglock_guard")
    mine = [f for f in run_checks(pg_dsn) if f.check == "guarded table" and table in f.message]
    assert [f.level for f in mine] == ["fail"]
    assert "disabled" in mine[0].message and "ENABLE TRIGGER" in mine[0].fix
    assert listed(pg_dsn)[table]["state"] == "DISABLED (writes are not checked)"
    done = cli("doctor", "--dsn", pg_dsn)
    assert done.returncode == 1 and table in done.stdout
