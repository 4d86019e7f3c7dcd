"""Inheritance children of a guarded table are guarded too: no side door through them (G8).

Rows stored in a child (``CREATE TABLE c () INHERITS (guarded)``) fire only the child's
triggers, even when the statement names the parent. install_guard guards every
inheritance descendant with the parent's template; the doctor fails on one added later.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import psycopg
import pytest
from psycopg import sql

from pglock_celery import ConfigurationError, install_guard, remove_guard, try_lock
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


@pytest.fixture
def family(admin: psycopg.Connection, schema: str) -> dict[str, str]:
    """A parent, a child with an extra column, a grandchild: one row each, tenant 'a'."""
    parent, child, grandchild = (f"{schema}.{n}" for n in ("parent", "child", "grandchild"))
    admin.execute(f"CREATE TABLE {parent} (tenant_id text NOT NULL, n int NOT NULL)")
    admin.execute(f"CREATE TABLE {child} (extra text DEFAULT 'x') INHERITS ({parent})")
    admin.execute(f"CREATE TABLE {grandchild} () INHERITS ({child})")
    for table in (parent, child, grandchild):
        admin.execute(f"INSERT INTO {table} (tenant_id, n) VALUES ('a', 0)")
    return {"parent": parent, "child": child, "grandchild": grandchild}


def refused(conn: psycopg.Connection, statement: str) -> psycopg.Error:
    with pytest.raises(psycopg.Error) as caught:
        conn.execute(statement)
    assert caught.value.sqlstate == GUARD_SQLSTATE, caught.value
    return caught.value


def counts(admin: psycopg.Connection, parent: str) -> list[tuple[str, int]]:
    """(table, n) of every row under ``parent``, by the table that stores it."""
    found = admin.execute(f"SELECT tableoid::regclass::text, n FROM {parent} ORDER BY 1").fetchall()
    return [(str(table), int(n)) for table, n in found]


def test_no_write_through_the_parent_reaches_a_childs_rows_without_the_lock(
    admin: psycopg.Connection, plain: psycopg.Connection, family: dict[str, str]
) -> None:
    parent = family["parent"]
    install_guard(admin, parent, TEMPLATE)
    before = counts(admin, parent)
    refused(plain, f"UPDATE {parent} SET n = n + 1")
    refused(plain, f"UPDATE {parent} SET n = n + 1 WHERE tableoid = '{family['child']}'::regclass")
    refused(plain, f"DELETE FROM {parent} WHERE tableoid <> '{parent}'::regclass")
    refused(plain, f"DELETE FROM {parent} WHERE tableoid = '{family['grandchild']}'::regclass")
    for table in (family["child"], family["grandchild"]):
        refused(plain, f"INSERT INTO {table} (tenant_id, n) VALUES ('b', 0)")
        refused(plain, f"UPDATE {table} SET n = 5")
        refused(plain, f"TRUNCATE {table}")
    refused(plain, f"TRUNCATE {parent}")
    assert counts(admin, parent) == before


def test_the_holder_writes_every_generation_through_the_parent(
    admin: psycopg.Connection, family: dict[str, str], pg_dsn: str
) -> None:
    parent = family["parent"]
    install_guard(pg_dsn, parent, TEMPLATE)
    with try_lock("inh:a", dsn=pg_dsn) as lock:
        assert lock.acquired
        lock.connection.execute(f"UPDATE {parent} SET n = n + 1")
        lock.connection.execute(f"INSERT INTO {family['child']} (tenant_id, n) VALUES ('a', 7)")
    assert sorted(n for _, n in counts(admin, parent)) == [1, 1, 1, 7]


def test_every_descendant_is_listed_with_the_parents_template(
    admin: psycopg.Connection, family: dict[str, str]
) -> None:
    install_guard(admin, family["parent"], TEMPLATE)
    shown = {t.table: t.lock_name for t in guarded_tables(admin)}
    assert {shown.get(table) for table in family.values()} == {TEMPLATE}


def guard_findings(dsn: str, schema: str) -> list[Finding]:
    return [f for f in run_checks(dsn) if f.check.startswith("guard") and schema in f.message]


def test_a_child_added_later_fails_the_doctor_until_install_runs_again(
    admin: psycopg.Connection, plain: psycopg.Connection, family: dict[str, str], pg_dsn: str
) -> None:
    parent, schema = family["parent"], family["parent"].split(".")[0]
    install_guard(admin, parent, TEMPLATE)
    assert all(f.level == "ok" for f in guard_findings(pg_dsn, schema))
    late = f"{schema}.late"
    admin.execute(f"CREATE TABLE {late} (note text) INHERITS ({family['grandchild']})")
    admin.execute(f"INSERT INTO {late} (tenant_id, n) VALUES ('a', 0)")
    failed = [f for f in guard_findings(pg_dsn, schema) if f.level == "fail"]
    assert len(failed) == 1, failed
    assert late in failed[0].message and parent in failed[0].message
    assert failed[0].fix == f"pglock-celery guard install {parent} --lock '{TEMPLATE}'"
    done = cli("doctor", dsn=pg_dsn)
    assert done.returncode == 1 and late in done.stdout
    install_guard(admin, parent, TEMPLATE)  # the fix the doctor names
    assert all(f.level == "ok" for f in guard_findings(pg_dsn, schema))
    refused(plain, f"UPDATE {parent} SET n = n + 1 WHERE tableoid = '{late}'::regclass")


def test_a_child_attached_with_alter_table_inherit_fails_the_doctor(
    admin: psycopg.Connection, schema: str, pg_dsn: str
) -> None:
    parent, stray = f"{schema}.p", f"{schema}.stray"
    admin.execute(f"CREATE TABLE {parent} (tenant_id text, n int)")
    admin.execute(f"CREATE TABLE {stray} (tenant_id text, n int)")
    install_guard(admin, parent, TEMPLATE)
    admin.execute(f"ALTER TABLE {stray} INHERIT {parent}")
    assert [f.level for f in guard_findings(pg_dsn, stray)] == ["fail"]


def test_a_childs_guard_disabled_or_removed_fails_the_doctor(
    admin: psycopg.Connection, family: dict[str, str], pg_dsn: str
) -> None:
    parent, child = family["parent"], family["child"]
    schema = parent.split(".")[0]
    install_guard(admin, parent, TEMPLATE)
    admin.execute(f"ALTER TABLE {child} DISABLE TRIGGER zz_pglock_guard")
    assert any(f.level == "fail" and child in f.message for f in guard_findings(pg_dsn, schema))
    install_guard(admin, parent, TEMPLATE)
    remove_guard(admin, child)
    # Removing the child's guard removes its own descendants' (same template) too.
    failed = [f for f in guard_findings(pg_dsn, schema) if f.level == "fail"]
    assert sorted(f.message.split()[0] for f in failed) == [child, family["grandchild"]]
    assert all(parent in f.fix for f in failed)


def test_a_child_guarded_with_another_template_is_refused_before_anything_changes(
    admin: psycopg.Connection, family: dict[str, str]
) -> None:
    parent, child = family["parent"], family["child"]
    install_guard(admin, child, "other:{tenant_id}")
    with pytest.raises(ConfigurationError, match=f"{child} .*other:\\{{tenant_id\\}}"):
        install_guard(admin, parent, TEMPLATE)
    shown = {t.table: t.lock_name for t in guarded_tables(admin)}
    assert parent not in shown
    assert shown[child] == shown[family["grandchild"]] == "other:{tenant_id}"


def test_a_descendant_cannot_get_a_template_other_than_its_guarded_ancestors(
    admin: psycopg.Connection, family: dict[str, str]
) -> None:
    install_guard(admin, family["parent"], TEMPLATE)
    with pytest.raises(ConfigurationError, match=f"inherits from {family['parent']}"):
        install_guard(admin, family["grandchild"], "other:{tenant_id}")
    install_guard(admin, family["grandchild"], TEMPLATE)  # the same template: fine
    assert {t.table: t.lock_name for t in guarded_tables(admin)}[family["grandchild"]] == TEMPLATE


def test_a_new_template_on_the_parent_moves_its_children_too(
    admin: psycopg.Connection, plain: psycopg.Connection, family: dict[str, str], pg_dsn: str
) -> None:
    install_guard(admin, family["parent"], TEMPLATE)
    install_guard(admin, family["parent"], "moved:{tenant_id}")
    shown = {t.table: t.lock_name for t in guarded_tables(admin)}
    assert {shown[table] for table in family.values()} == {"moved:{tenant_id}"}
    with try_lock("inh:a", dsn=pg_dsn) as lock:
        refused(lock.connection, f"UPDATE {family['parent']} SET n = n + 1")


def test_removing_the_parents_guard_removes_its_childrens(
    admin: psycopg.Connection, plain: psycopg.Connection, family: dict[str, str]
) -> None:
    install_guard(admin, family["parent"], TEMPLATE)
    remove_guard(admin, family["parent"])
    assert not set(family.values()) & {t.table for t in guarded_tables(admin)}
    plain.execute(f"UPDATE {family['parent']} SET n = n + 1")
    assert [n for _, n in counts(admin, family["parent"])] == [1, 1, 1]


def test_a_foreign_table_child_is_refused(admin: psycopg.Connection, schema: str) -> None:
    """A foreign table stores its rows elsewhere: the guard cannot vouch for them."""
    parent = f"{schema}.p"
    admin.execute(f"CREATE TABLE {parent} (tenant_id text, n int)")
    admin.execute(f"CREATE FOREIGN DATA WRAPPER {schema}_fdw")
    admin.execute(f"CREATE SERVER {schema}_srv FOREIGN DATA WRAPPER {schema}_fdw")
    try:
        admin.execute(
            f"CREATE FOREIGN TABLE {schema}.remote () INHERITS ({parent}) SERVER {schema}_srv"
        )
        with pytest.raises(ConfigurationError, match="foreign table"):
            install_guard(admin, parent, TEMPLATE)
        assert parent not in {t.table for t in guarded_tables(admin)}
    finally:
        admin.execute(f"DROP SERVER {schema}_srv CASCADE")
        admin.execute(f"DROP FOREIGN DATA WRAPPER {schema}_fdw")
