"""A role's search_path cannot redirect the guard's built-ins (G8).

A real role whose search_path puts a schema of impostor functions and operators before
pg_catalog writes to a guarded table: every impostor would let a write through that the
guard must refuse (the guard's SQL names pg_catalog's functions and runs its functions
with search_path = pg_catalog, pg_temp).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import make_conninfo

from pglock_celery import install_guard, lock_key
from pglock_celery.doctor import run_checks
from pglock_celery.guard import GUARD_SQLSTATE

TEMPLATE = "sp:{tenant_id}"

#: name -> the impostors' SQL ({s}: their schema). Each alone lets a lockless write through
#: a guard that calls the built-in by its bare name under the caller's search_path.
IMPOSTORS = {
    # The guard's "is it off?" test reads the setting: say "off".
    "current_setting": "CREATE FUNCTION {s}.current_setting(text, boolean) RETURNS text"
    " LANGUAGE sql AS $$SELECT 'off'::text$$",
    "lower": "CREATE FUNCTION {s}.lower(text) RETURNS text LANGUAGE sql AS $$SELECT 'off'$$",
    # The fast path: the key "is" in pglock.held, and nobody else holds it.
    "strpos and the try": "CREATE FUNCTION {s}.strpos(text, text) RETURNS integer"
    " LANGUAGE sql AS $$SELECT 1$$;"
    " CREATE FUNCTION {s}.pg_try_advisory_xact_lock(bigint) RETURNS boolean"
    " LANGUAGE sql AS $$SELECT true$$",
    # Every row's key becomes the key of the lock the writer holds.
    "md5": "CREATE FUNCTION {s}.md5(text) RETURNS text LANGUAGE sql"
    " AS $$SELECT pg_catalog.md5('sp:a')$$",
    # strpos(...) = 0 is never true: the key "is" in pglock.held.
    "the = operator": "CREATE FUNCTION {s}.never(integer, integer) RETURNS boolean"
    " LANGUAGE sql AS $$SELECT false$$;"
    " CREATE OPERATOR {s}.= (LEFTARG = integer, RIGHTARG = integer, FUNCTION = {s}.never)",
}


@pytest.fixture
def admin(pg_dsn: str) -> Iterator[psycopg.Connection]:
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("SET pglock.guard = off")
        yield conn


@pytest.fixture
def table(admin: psycopg.Connection) -> Iterator[str]:
    schema = f"guard_sp_{uuid.uuid4().hex[:8]}"
    admin.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(schema)))
    name = f"{schema}.jobs"
    admin.execute(f"CREATE TABLE {name} (tenant_id text, n int)")
    admin.execute(f"INSERT INTO {name} VALUES ('a', 0), ('b', 0)")
    install_guard(admin, name, TEMPLATE)
    yield name
    admin.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(schema)))


@pytest.fixture(params=sorted(IMPOSTORS))
def hostile(
    request: pytest.FixtureRequest, admin: psycopg.Connection, table: str, pg_dsn: str
) -> Iterator[psycopg.Connection]:
    """A session of a real role whose search_path puts the impostors first."""
    tag = uuid.uuid4().hex[:8]
    role, evil = f"pglock_sp_role_{tag}", f"pglock_sp_evil_{tag}"
    admin.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(evil)))
    admin.execute(IMPOSTORS[request.param].format(s=evil))
    admin.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(role)))
    admin.execute(
        sql.SQL("ALTER ROLE {} SET search_path = {}, pg_catalog, public").format(
            sql.Identifier(role), sql.Identifier(evil)
        )
    )
    schema = table.split(".")[0]
    for target in (evil, schema):
        admin.execute(
            sql.SQL("GRANT USAGE ON SCHEMA {} TO {}").format(
                sql.Identifier(target), sql.Identifier(role)
            )
        )
    admin.execute(sql.SQL("GRANT SELECT, INSERT, UPDATE, DELETE, TRUNCATE ON {} TO {}").format(
        sql.SQL(table), sql.Identifier(role)
    ))  # fmt: skip
    try:
        with psycopg.connect(make_conninfo(pg_dsn, user=role), autocommit=True) as conn:
            shown = conn.execute("SHOW search_path").fetchone()
            assert shown is not None and shown[0].startswith(evil)
            yield conn
    finally:
        admin.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(evil)))
        admin.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
        admin.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


def rows(admin: psycopg.Connection, table: str) -> dict[str, int]:
    return dict(admin.execute(f"SELECT tenant_id, n FROM {table}").fetchall())  # type: ignore[arg-type]


def test_a_lockless_write_is_refused_whatever_the_search_path_holds(
    hostile: psycopg.Connection, admin: psycopg.Connection, table: str
) -> None:
    for statement in (
        f"UPDATE {table} SET n = n + 1 WHERE tenant_id = 'b'",
        f"INSERT INTO {table} VALUES ('c', 0)",
        f"DELETE FROM {table} WHERE tenant_id = 'b'",
        f"TRUNCATE {table}",
    ):
        with pytest.raises(psycopg.Error) as caught:
            hostile.execute(statement)
        assert caught.value.sqlstate == GUARD_SQLSTATE, caught.value
    assert rows(admin, table) == {"a": 0, "b": 0}


def test_a_holder_of_one_tenant_still_writes_only_that_tenant(
    hostile: psycopg.Connection, admin: psycopg.Connection, table: str
) -> None:
    hostile.execute("SELECT pg_catalog.pg_advisory_lock(%s)", (lock_key("sp:a"),))
    try:
        with pytest.raises(psycopg.Error) as caught:
            hostile.execute(f"UPDATE {table} SET n = n + 1 WHERE tenant_id = 'b'")
        assert caught.value.sqlstate == GUARD_SQLSTATE, caught.value
        hostile.execute(f"UPDATE {table} SET n = n + 1 WHERE tenant_id = 'a'")
    finally:
        hostile.execute("SELECT pg_catalog.pg_advisory_unlock_all()")
    assert rows(admin, table) == {"a": 1, "b": 0}


def test_the_guards_functions_run_with_a_pinned_search_path(
    admin: psycopg.Connection, table: str
) -> None:
    found = admin.execute(
        "SELECT p.oid::regprocedure::text, p.proconfig"
        " FROM pg_proc p JOIN pg_language l ON l.oid = p.prolang"
        " WHERE p.proname LIKE 'pglock\\_guard%%' AND l.lanname = 'plpgsql'"
        " AND (p.pronamespace = 'public'::regnamespace OR p.pronamespace = %s::regnamespace)",
        (table.split(".")[0],),
    ).fetchall()
    assert len(found) >= 3, found  # the table's trigger function, the check, TRUNCATE
    for name, config in found:
        assert config == ["search_path=pg_catalog, pg_temp"], name


def test_the_doctor_fails_on_a_search_path_that_shadows_a_builtin(
    hostile: psycopg.Connection, pg_dsn: str
) -> None:
    row = hostile.execute("SELECT current_user, (current_schemas(false))[1]").fetchone()
    assert row is not None
    role, evil = row
    (finding,) = [
        f for f in run_checks(make_conninfo(pg_dsn, user=role)) if f.check == "search_path"
    ]
    assert finding.level == "fail", finding
    assert f"{evil}." in finding.message
    assert "pg_catalog first" in finding.fix
    (plain,) = [f for f in run_checks(pg_dsn) if f.check == "search_path"]
    assert plain.level == "ok", plain
