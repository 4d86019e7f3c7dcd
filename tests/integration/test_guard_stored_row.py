"""The guard judges the row as it will be stored (G8): later triggers, cascades, TRUNCATE.

A table's own BEFORE trigger that fires after ``zz_pglock_guard`` (its name sorts later)
may rewrite the row's lock columns; the guard re-checks the stored row after every
BEFORE trigger has run, in the same statement.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import psycopg
import pytest
from psycopg import sql

from pglock_celery import install_guard, lock_key, try_lock
from pglock_celery.doctor import run_checks
from pglock_celery.guard import GUARD_SQLSTATE, guarded_tables
from tests.integration.test_cli import cli

TEMPLATE = "stored:{tenant_id}"


@pytest.fixture
def admin(pg_dsn: str) -> Iterator[psycopg.Connection]:
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("SET pglock.guard = off")
        yield conn


@pytest.fixture
def plain(pg_dsn: str) -> Iterator[psycopg.Connection]:
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        yield conn


@pytest.fixture
def schema(admin: psycopg.Connection) -> Iterator[str]:
    name = f"guard_stored_{uuid.uuid4().hex[:8]}"
    admin.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(name)))
    yield name
    admin.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(name)))


@pytest.fixture
def table(admin: psycopg.Connection, schema: str) -> str:
    """A guarded table with rows of tenants a and b."""
    name = f"{schema}.jobs"
    admin.execute(f"CREATE TABLE {name} (id int PRIMARY KEY, tenant_id text NOT NULL, n int)")
    admin.execute(f"INSERT INTO {name} VALUES (1, 'a', 0), (2, 'b', 0)")
    install_guard(admin, name, TEMPLATE)
    return name


def retarget_after_the_guard(admin: psycopg.Connection, table: str, ops: str) -> None:
    """A BEFORE trigger named after zz_pglock_guard that moves every row to tenant 'victim'."""
    admin.execute(
        f"CREATE FUNCTION {table}_move() RETURNS trigger LANGUAGE plpgsql AS"
        " $$BEGIN NEW.tenant_id := 'victim'; RETURN NEW; END$$"
    )
    admin.execute(
        f"CREATE TRIGGER zzz_move BEFORE {ops} ON {table}"
        f" FOR EACH ROW EXECUTE FUNCTION {table}_move()"
    )


def refused(conn: psycopg.Connection, statement: str) -> psycopg.Error:
    with pytest.raises(psycopg.Error) as caught:
        conn.execute(statement)
    assert caught.value.sqlstate == GUARD_SQLSTATE, caught.value
    return caught.value


def rows(admin: psycopg.Connection, table: str) -> list[tuple[int, str, int]]:
    return admin.execute(f"SELECT id, tenant_id, n FROM {table} ORDER BY id").fetchall()


def test_an_insert_moved_by_a_later_trigger_needs_the_stored_rows_lock(
    admin: psycopg.Connection, table: str, pg_dsn: str
) -> None:
    retarget_after_the_guard(admin, table, "INSERT")
    before = rows(admin, table)
    with try_lock("stored:a", dsn=pg_dsn) as lock:
        assert lock.acquired
        error = refused(lock.connection, f"INSERT INTO {table} VALUES (3, 'a', 0)")
    assert '"stored:victim"' in str(error)
    assert rows(admin, table) == before
    with try_lock("stored:a", dsn=pg_dsn) as a, a.connection.transaction():
        a.connection.execute("SELECT pg_advisory_xact_lock(%s)", (lock_key("stored:victim"),))
        a.connection.execute(f"INSERT INTO {table} VALUES (3, 'a', 0)")
    assert rows(admin, table)[-1] == (3, "victim", 0)


def test_an_update_moved_by_a_later_trigger_needs_the_stored_rows_lock(
    admin: psycopg.Connection, table: str, pg_dsn: str
) -> None:
    retarget_after_the_guard(admin, table, "UPDATE")
    before = rows(admin, table)
    with try_lock("stored:a", dsn=pg_dsn) as lock:
        error = refused(lock.connection, f"UPDATE {table} SET n = n + 1 WHERE id = 1")
    assert '"stored:victim"' in str(error)
    assert rows(admin, table) == before


def test_a_later_trigger_that_leaves_the_name_alone_costs_the_holder_nothing(
    admin: psycopg.Connection, table: str, pg_dsn: str
) -> None:
    admin.execute(
        f"CREATE FUNCTION {table}_bump() RETURNS trigger LANGUAGE plpgsql AS"
        " $$BEGIN NEW.n := NEW.n + 100; RETURN NEW; END$$"
    )
    admin.execute(
        f"CREATE TRIGGER zzz_bump BEFORE INSERT OR UPDATE ON {table}"
        f" FOR EACH ROW EXECUTE FUNCTION {table}_bump()"
    )
    with try_lock("stored:a", dsn=pg_dsn) as lock:
        lock.connection.execute(f"UPDATE {table} SET n = n + 1 WHERE id = 1")
        lock.connection.execute(f"INSERT INTO {table} VALUES (3, 'a', 0)")
    assert rows(admin, table) == [(1, "a", 101), (2, "b", 0), (3, "a", 100)]


def test_an_update_that_changes_the_name_still_needs_both_locks(
    admin: psycopg.Connection, table: str, pg_dsn: str
) -> None:
    move = f"UPDATE {table} SET tenant_id = 'c' WHERE id = 1"
    for held in ("a", "c"):
        with try_lock(f"stored:{held}", dsn=pg_dsn) as lock:
            refused(lock.connection, move)
    with try_lock("stored:a", dsn=pg_dsn) as lock, lock.connection.transaction():
        lock.connection.execute("SELECT pg_advisory_xact_lock(%s)", (lock_key("stored:c"),))
        lock.connection.execute(move)
    assert rows(admin, table)[0] == (1, "c", 0)


@pytest.fixture
def tenants(admin: psycopg.Connection, schema: str, table: str) -> str:
    """An unguarded table that the guarded one references, with cascades both ways."""
    name = f"{schema}.tenants"
    admin.execute(f"CREATE TABLE {name} (tenant_id text PRIMARY KEY)")
    admin.execute(f"INSERT INTO {name} VALUES ('a'), ('b')")
    admin.execute(
        f"ALTER TABLE {table} ADD FOREIGN KEY (tenant_id) REFERENCES {name}"
        " ON DELETE CASCADE ON UPDATE CASCADE"
    )
    return name


def test_a_cascade_from_another_table_is_a_write_that_needs_the_lock(
    admin: psycopg.Connection, plain: psycopg.Connection, table: str, tenants: str, pg_dsn: str
) -> None:
    before = rows(admin, table)
    refused(plain, f"DELETE FROM {tenants} WHERE tenant_id = 'a'")
    refused(plain, f"UPDATE {tenants} SET tenant_id = 'z' WHERE tenant_id = 'b'")
    with try_lock("stored:b", dsn=pg_dsn) as lock:  # the old name's lock, not the new one's
        refused(lock.connection, f"UPDATE {tenants} SET tenant_id = 'z' WHERE tenant_id = 'b'")
    assert rows(admin, table) == before
    with try_lock("stored:a", dsn=pg_dsn) as lock:
        lock.connection.execute(f"DELETE FROM {tenants} WHERE tenant_id = 'a'")
    assert rows(admin, table) == before[1:]


def test_a_truncate_cascading_into_the_guarded_table_is_refused(
    admin: psycopg.Connection, plain: psycopg.Connection, table: str, tenants: str
) -> None:
    before = rows(admin, table)
    error = refused(plain, f"TRUNCATE {tenants} CASCADE")
    assert "TRUNCATE" in str(error)
    assert rows(admin, table) == before


def test_a_guard_without_its_stored_row_check_is_reported_and_repaired_by_install(
    admin: psycopg.Connection, table: str, pg_dsn: str
) -> None:
    """A guard from an older release (no re-check of the stored row) is not the whole guard."""
    stored = admin.execute(
        "SELECT tgname FROM pg_trigger WHERE tgrelid = %s::regclass"
        " AND tgname LIKE 'zz\\_pglock\\_guard\\_stored%%'",
        (table,),
    ).fetchall()
    assert stored, "install_guard put no stored-row check on the table"
    for (name,) in stored:
        admin.execute(sql.SQL("DROP TRIGGER {} ON {}").format(sql.Identifier(name), sql.SQL(table)))
    (shown,) = [t for t in guarded_tables(admin) if t.table == table]
    assert not shown.stored_row_guarded
    listed = cli("guard", "list", dsn=pg_dsn).stdout
    assert "INCOMPLETE (the row as stored is not checked: install again)" in listed
    mine = [f for f in run_checks(pg_dsn) if f.check == "guarded table" and table in f.message]
    assert [f.level for f in mine] == ["fail"]
    assert "pglock-celery guard install" in mine[0].fix
    install_guard(admin, table, TEMPLATE)
    (shown,) = [t for t in guarded_tables(admin) if t.table == table]
    assert shown.stored_row_guarded


def test_a_row_a_later_trigger_moves_into_the_writers_lock_is_judged_as_stored(
    admin: psycopg.Connection, table: str, pg_dsn: str
) -> None:
    """Judged as stored, both ways: the name the row is stored under is the one that counts."""
    admin.execute(
        f"CREATE FUNCTION {table}_to_a() RETURNS trigger LANGUAGE plpgsql AS"
        " $$BEGIN NEW.tenant_id := 'a'; RETURN NEW; END$$"
    )
    admin.execute(
        f"CREATE TRIGGER zzz_to_a BEFORE INSERT ON {table}"
        f" FOR EACH ROW EXECUTE FUNCTION {table}_to_a()"
    )
    with try_lock("stored:a", dsn=pg_dsn) as lock:
        lock.connection.execute(f"INSERT INTO {table} VALUES (3, 'elsewhere', 0)")
    assert rows(admin, table)[-1] == (3, "a", 0)


def test_an_update_moving_a_row_to_another_partition_needs_both_locks(
    admin: psycopg.Connection, plain: psycopg.Connection, schema: str, pg_dsn: str
) -> None:
    """Postgres runs it as a DELETE from one partition and an INSERT into another."""
    parent = f"{schema}.parted"
    admin.execute(f"CREATE TABLE {parent} (tenant_id text, n int) PARTITION BY LIST (tenant_id)")
    admin.execute(f"CREATE TABLE {parent}_a PARTITION OF {parent} FOR VALUES IN ('a')")
    admin.execute(f"CREATE TABLE {parent}_b PARTITION OF {parent} FOR VALUES IN ('b')")
    admin.execute(f"INSERT INTO {parent} VALUES ('a', 0)")
    install_guard(admin, parent, TEMPLATE)
    move = f"UPDATE {parent} SET tenant_id = 'b'"
    refused(plain, move)
    for held in ("a", "b"):
        with try_lock(f"stored:{held}", dsn=pg_dsn) as lock:
            refused(lock.connection, move)
    with try_lock("stored:a", dsn=pg_dsn) as lock, lock.connection.transaction():
        lock.connection.execute("SELECT pg_advisory_xact_lock(%s)", (lock_key("stored:b"),))
        lock.connection.execute(move)
    found = admin.execute(f"SELECT tableoid::regclass::text, tenant_id FROM {parent}").fetchall()
    assert found == [(f"{parent}_b", "b")]
