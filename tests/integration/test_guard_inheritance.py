"""A table in an inheritance tree is refused by install_guard; partitions stay guarded (G8).

A row stored in an inheritance child (``CREATE TABLE c () INHERITS (p)``) fires only the
child's triggers, whatever table the statement names, so no trigger on one table guards
the tree. install_guard refuses such a table, naming it and pointing at declarative
partitioning, whose partitions Postgres gives the partitioned table's row triggers
(later ones too). A guarded table that gains a child afterwards fails the doctor.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import psycopg
import pytest
from psycopg import sql

from pglock_celery import ConfigurationError, install_guard, try_lock
from pglock_celery.doctor import Finding, run_checks
from pglock_celery.guard import GUARD_SQLSTATE, guarded_tables
from tests.integration.test_cli import cli

TEMPLATE = "inh:{tenant_id}"


@pytest.fixture
def admin(pg_dsn: str) -> Iterator[psycopg.Connection]:
    """A session that passes the guard (it turns it off for itself)."""
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("SET pglock.guard = off")
        yield conn


@pytest.fixture
def plain(pg_dsn: str) -> Iterator[psycopg.Connection]:
    """A session that takes no lock."""
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        yield conn


@pytest.fixture
def schema(admin: psycopg.Connection) -> Iterator[str]:
    name = f"guard_inh_{uuid.uuid4().hex[:8]}"
    admin.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(name)))
    yield name
    admin.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(name)))


def refused(conn: psycopg.Connection, statement: str) -> psycopg.Error:
    with pytest.raises(psycopg.Error) as caught:
        conn.execute(statement)
    assert caught.value.sqlstate == GUARD_SQLSTATE, caught.value
    return caught.value


def triggers(admin: psycopg.Connection, table: str) -> list[str]:
    found = admin.execute(
        "SELECT tgname FROM pg_trigger WHERE tgrelid = %s::regclass AND NOT tgisinternal",
        (table,),
    ).fetchall()
    return sorted(str(name) for (name,) in found)


def guard_findings(dsn: str, schema: str) -> list[Finding]:
    return [f for f in run_checks(dsn) if f.check.startswith("guard") and schema in f.message]


# --- refused at install ------------------------------------------------------------------------


@pytest.mark.parametrize("member", ["parent", "child", "grandchild"])
def test_a_table_in_an_inheritance_tree_is_refused_naming_it_and_partitioning(
    admin: psycopg.Connection, schema: str, member: str
) -> None:
    parent, child, grandchild = (f"{schema}.{n}" for n in ("parent", "child", "grandchild"))
    admin.execute(f"CREATE TABLE {parent} (tenant_id text NOT NULL, n int NOT NULL)")
    admin.execute(f"CREATE TABLE {child} (extra text) INHERITS ({parent})")
    admin.execute(f"CREATE TABLE {grandchild} () INHERITS ({child})")
    table = f"{schema}.{member}"
    with pytest.raises(ConfigurationError) as caught:
        install_guard(admin, table, TEMPLATE)
    message = str(caught.value)
    assert f"{table} is in an inheritance tree" in message
    assert "PARTITION BY" in message and "NO INHERIT" in message
    assert (f"{child} inherits from {parent}" in message) == (member != "grandchild")
    assert (f"{grandchild} inherits from {child}" in message) == (member != "parent")
    for each in (parent, child, grandchild):
        assert triggers(admin, each) == []
    assert not {parent, child, grandchild} & {t.table for t in guarded_tables(admin)}


def test_a_table_with_a_foreign_table_child_is_refused(
    admin: psycopg.Connection, schema: str
) -> None:
    parent = f"{schema}.p"
    admin.execute(f"CREATE TABLE {parent} (tenant_id text, n int)")
    admin.execute(f"CREATE FOREIGN DATA WRAPPER {schema}_fdw")
    admin.execute(f"CREATE SERVER {schema}_srv FOREIGN DATA WRAPPER {schema}_fdw")
    try:
        admin.execute(
            f"CREATE FOREIGN TABLE {schema}.remote () INHERITS ({parent}) SERVER {schema}_srv"
        )
        with pytest.raises(ConfigurationError, match=f"{schema}.remote inherits from {parent}"):
            install_guard(admin, parent, TEMPLATE)
        assert triggers(admin, parent) == []
    finally:
        admin.execute(f"DROP SERVER {schema}_srv CASCADE")
        admin.execute(f"DROP FOREIGN DATA WRAPPER {schema}_fdw")


def test_the_cli_refuses_a_table_in_an_inheritance_tree_in_one_line(
    admin: psycopg.Connection, schema: str, pg_dsn: str
) -> None:
    parent, child = f"{schema}.parent", f"{schema}.child"
    admin.execute(f"CREATE TABLE {parent} (tenant_id text, n int)")
    admin.execute(f"CREATE TABLE {child} () INHERITS ({parent})")
    done = cli("guard", "install", parent, "--lock", TEMPLATE, dsn=pg_dsn)
    assert done.returncode == 2, done.stdout
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert f"{parent} is in an inheritance tree" in done.stderr
    assert "PARTITION BY" in done.stderr
    assert triggers(admin, parent) == triggers(admin, child) == []


# --- partitions stay guarded -------------------------------------------------------------------


def test_partitions_created_and_attached_after_install_are_guarded(
    admin: psycopg.Connection, plain: psycopg.Connection, schema: str, pg_dsn: str
) -> None:
    parted = f"{schema}.parted"
    admin.execute(f"CREATE TABLE {parted} (tenant_id text, n int) PARTITION BY LIST (tenant_id)")
    admin.execute(f"CREATE TABLE {parted}_a PARTITION OF {parted} FOR VALUES IN ('a')")
    install_guard(admin, parted, TEMPLATE)
    admin.execute(f"CREATE TABLE {parted}_b PARTITION OF {parted} FOR VALUES IN ('b')")
    admin.execute(f"CREATE TABLE {parted}_c (tenant_id text, n int)")
    admin.execute(f"INSERT INTO {parted}_c VALUES ('c', 0)")
    admin.execute(f"ALTER TABLE {parted} ATTACH PARTITION {parted}_c FOR VALUES IN ('c')")
    admin.execute(f"INSERT INTO {parted} VALUES ('a', 0), ('b', 0)")
    for tenant in "abc":
        partition = f"{parted}_{tenant}"
        for target in (parted, partition):
            where = f"WHERE tenant_id = '{tenant}'"
            refused(plain, f"UPDATE {target} SET n = n + 1 {where}")
            refused(plain, f"INSERT INTO {target} VALUES ('{tenant}', 1)")
            refused(plain, f"DELETE FROM {target} {where}")
        with try_lock(f"inh:{tenant}", dsn=pg_dsn) as lock:
            assert lock.acquired
            lock.connection.execute(f"UPDATE {partition} SET n = n + 1")
            lock.connection.execute(f"INSERT INTO {parted} VALUES ('{tenant}', 5)")
    found = admin.execute(f"SELECT tenant_id, n FROM {parted} ORDER BY 1, 2").fetchall()
    assert found == [("a", 1), ("a", 5), ("b", 1), ("b", 5), ("c", 1), ("c", 5)]
    assert all(f.level == "ok" for f in guard_findings(pg_dsn, schema))


def test_a_partition_can_be_guarded_on_its_own(
    admin: psycopg.Connection, plain: psycopg.Connection, schema: str
) -> None:
    """A partition's parent is a partitioned table, not an inheritance parent."""
    parted = f"{schema}.parted"
    admin.execute(f"CREATE TABLE {parted} (tenant_id text, n int) PARTITION BY LIST (tenant_id)")
    admin.execute(
        f"CREATE TABLE {parted}_a PARTITION OF {parted} FOR VALUES IN ('a') PARTITION BY LIST (n)"
    )
    admin.execute(f"CREATE TABLE {parted}_a0 PARTITION OF {parted}_a FOR VALUES IN (0)")
    admin.execute(f"CREATE TABLE {parted}_b PARTITION OF {parted} FOR VALUES IN ('b')")
    admin.execute(f"INSERT INTO {parted} VALUES ('a', 0), ('b', 0)")
    install_guard(admin, f"{parted}_a", TEMPLATE)
    install_guard(admin, f"{parted}_b", TEMPLATE)
    refused(plain, f"UPDATE {parted} SET n = n + 1 WHERE tenant_id = 'b'")
    refused(plain, f"DELETE FROM {parted}_a0")
    assert {f"{parted}_a", f"{parted}_b"} <= {t.table for t in guarded_tables(admin)}


# --- a child gained after install ---------------------------------------------------------------


@pytest.mark.parametrize("how", ["CREATE TABLE ... INHERITS", "ALTER TABLE ... INHERIT"])
def test_a_guarded_table_that_gains_an_inheritance_child_fails_the_doctor(
    admin: psycopg.Connection, plain: psycopg.Connection, schema: str, pg_dsn: str, how: str
) -> None:
    parent, child = f"{schema}.parent", f"{schema}.child"
    admin.execute(f"CREATE TABLE {parent} (tenant_id text, n int)")
    install_guard(admin, parent, TEMPLATE)
    assert [f.level for f in guard_findings(pg_dsn, schema)] == ["ok"]
    if how.startswith("CREATE"):
        admin.execute(f"CREATE TABLE {child} () INHERITS ({parent})")
    else:
        admin.execute(f"CREATE TABLE {child} (tenant_id text, n int)")
        admin.execute(f"ALTER TABLE {child} INHERIT {parent}")
    # Why it is a finding: a write naming the child fires none of the parent's triggers.
    plain.execute(f"INSERT INTO {child} VALUES ('a', 0)")
    plain.execute(f"UPDATE {child} SET n = 1")
    (finding,) = guard_findings(pg_dsn, schema)
    assert finding.level == "fail"
    assert f"{parent} (lock {TEMPLATE}) has inheritance children ({child})" in finding.message
    assert (
        "PARTITION BY" in finding.fix and f"ALTER TABLE {child} NO INHERIT {parent}" in finding.fix
    )
    done = cli("doctor", dsn=pg_dsn)
    assert done.returncode == 1 and child in done.stdout
    with pytest.raises(ConfigurationError, match="inheritance tree"):
        install_guard(admin, parent, TEMPLATE)
    refused(plain, f"INSERT INTO {parent} VALUES ('a', 0)")  # its own guard is still on
    admin.execute(f"ALTER TABLE {child} NO INHERIT {parent}")  # the fix the doctor names
    assert [f.level for f in guard_findings(pg_dsn, schema)] == ["ok"]
