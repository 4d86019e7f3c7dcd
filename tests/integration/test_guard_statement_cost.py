"""The guard checks a plain table by statement (G8): each lock name once, nothing refused stored.

A plain table's guard reads each statement's rows from its transition tables and checks
each distinct lock name once, at the end of the statement, which it aborts on a refusal.
These tests close the doors that opens or could open: statements over several tenants,
many rows (COPY, INSERT ... SELECT, MERGE, ON CONFLICT, writable CTEs, views), names
changed in bulk, savepoints, collations that call two names equal, a table attached
under an unguarded parent, and a database guarded by the previous release.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg import sql

from pglock_celery import install_guard, lock_key, remove_guard, try_lock
from pglock_celery.guard import GUARD_SQLSTATE, guarded_tables
from tests.support.ci import missing

ROWS = 3_000


@pytest.fixture
def admin(pg_dsn: str) -> Iterator[psycopg.Connection]:
    """A session that passes the guard (it turns it off for itself)."""
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("SET pglock.guard = off")
        yield conn


@pytest.fixture
def plain(pg_dsn: str) -> Iterator[psycopg.Connection]:
    """A session that takes no lock of the library (hand-rolled locks, if any)."""
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        yield conn


@pytest.fixture
def schema(admin: psycopg.Connection) -> Iterator[str]:
    name = f"guard_stmt_{uuid.uuid4().hex[:8]}"
    admin.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(name)))
    yield name
    admin.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(name)))


@pytest.fixture
def template(run_id: str) -> str:
    """A template of the test's own, so that no other test's locks count."""
    return f"st{run_id}:{{tenant_id}}"


@pytest.fixture
def table(admin: psycopg.Connection, schema: str, template: str) -> str:
    """A guarded plain table: ROWS rows of tenant a, one of tenant b (id 0)."""
    name = f"{schema}.jobs"
    admin.execute(f"CREATE TABLE {name} (id int PRIMARY KEY, tenant_id text NOT NULL, n int)")
    admin.execute(f"INSERT INTO {name} SELECT g, 'a', 0 FROM generate_series(1, %s) g", (ROWS,))
    admin.execute(f"INSERT INTO {name} VALUES (0, 'b', 0)")
    install_guard(admin, name, template)
    return name


def refused(conn: psycopg.Connection, statement: str, params: Any = None) -> psycopg.Error:
    with pytest.raises(psycopg.Error) as caught:
        conn.execute(statement, params)
    assert caught.value.sqlstate == GUARD_SQLSTATE, caught.value
    return caught.value


def state(admin: psycopg.Connection, table: str) -> list[tuple[Any, ...]]:
    """Per tenant: rows, sum of n, smallest and largest id."""
    return admin.execute(
        f"SELECT tenant_id, count(*), sum(n), min(id), max(id) FROM {table}"
        " GROUP BY tenant_id ORDER BY tenant_id"
    ).fetchall()


def take_too(conn: psycopg.Connection, name: str) -> None:
    """Hold ``name`` as well, for the rest of the connection's transaction."""
    conn.execute("SELECT pg_advisory_xact_lock(%s)", (lock_key(name),))


def slow_path_calls(conn: psycopg.Connection, statement: str) -> int:
    """Run ``statement`` in a transaction of its own; count its calls of the pg_locks path.

    The count read before it is subtracted: a backend's pending counts may still hold
    an earlier transaction's calls (they are flushed at most once a second).
    """
    calls = (
        "SELECT coalesce(pg_stat_get_xact_function_calls("
        "'public.pglock_guard_check(text,name,name,text,bigint)'::regprocedure), 0)"
    )
    with conn.transaction():
        conn.execute("SET LOCAL track_functions = 'all'")
        before = conn.execute(calls).fetchone()
        conn.execute(statement)
        after = conn.execute(calls).fetchone()
    assert before is not None and after is not None
    return int(after[0]) - int(before[0])


def trigger_levels(admin: psycopg.Connection, table: str) -> dict[str, str]:
    """Each of the table's own guard triggers: ROW or STATEMENT (pg_trigger.tgtype bit 1)."""
    found = admin.execute(
        "SELECT tgname, CASE WHEN tgtype & 1 = 1 THEN 'ROW' ELSE 'STATEMENT' END"
        " FROM pg_trigger WHERE tgrelid = %s::regclass AND tgname LIKE 'zz\\_pglock\\_guard%%'"
        " AND tgparentid = 0",
        (table,),
    ).fetchall()
    return dict(found)  # type: ignore[arg-type]


# --- one statement, several tenants or many rows -------------------------------------


@pytest.mark.parametrize(
    "statement",
    [
        "UPDATE {t} SET n = n + 1",
        "DELETE FROM {t} WHERE id <= 10 OR tenant_id = 'b'",
        "INSERT INTO {t} VALUES (-1, 'a', 0), (-2, 'b', 0)",
        "UPDATE {t} SET n = n + 1 WHERE id IN (1, 0)",
    ],
)
def test_a_statement_over_two_tenants_with_one_lock_changes_nothing(
    admin: psycopg.Connection, table: str, template: str, pg_dsn: str, statement: str
) -> None:
    before = state(admin, table)
    with try_lock(template.format(tenant_id="a"), dsn=pg_dsn) as lock:
        assert lock.acquired
        error = refused(lock.connection, statement.format(t=table))
    assert f'"{template.format(tenant_id="b")}"' in str(error)
    assert state(admin, table) == before


def test_the_holder_updates_and_deletes_its_many_rows_in_one_statement(
    admin: psycopg.Connection, table: str, template: str, pg_dsn: str
) -> None:
    with try_lock(template.format(tenant_id="a"), dsn=pg_dsn) as lock:
        lock.connection.execute(f"UPDATE {table} SET n = n + 1 WHERE tenant_id = 'a'")
        lock.connection.execute(f"DELETE FROM {table} WHERE tenant_id = 'a' AND id > 10")
    assert state(admin, table) == [("a", 10, 10, 1, 10), ("b", 1, 0, 0, 0)]


def test_a_statement_checks_each_lock_name_once_not_each_row(
    plain: psycopg.Connection, table: str, template: str
) -> None:
    """A hand-rolled holder's slow path reads pg_locks once per name, not per row."""
    plain.execute("SELECT pg_advisory_lock(%s)", (lock_key(template.format(tenant_id="a")),))
    plain.execute("SELECT pg_advisory_lock(%s)", (lock_key(template.format(tenant_id="b")),))
    try:
        assert slow_path_calls(plain, f"UPDATE {table} SET n = n + 1") == 2  # ROWS + 1 rows
        assert slow_path_calls(plain, f"UPDATE {table} SET n = n + 1 WHERE tenant_id = 'a'") == 1
    finally:
        plain.execute("SELECT pg_advisory_unlock_all()")


def test_copy_of_many_rows_needs_the_lock_of_every_row(
    admin: psycopg.Connection, table: str, template: str, pg_dsn: str
) -> None:
    before = state(admin, table)
    with try_lock(template.format(tenant_id="a"), dsn=pg_dsn) as lock:
        conn = lock.connection
        with pytest.raises(psycopg.Error) as caught:  # one row of b among ROWS of a
            with conn.cursor().copy(f"COPY {table} FROM STDIN") as copy:
                for i in range(ROWS):
                    copy.write_row((ROWS + 1 + i, "b" if i == ROWS // 2 else "a", 0))
        assert caught.value.sqlstate == GUARD_SQLSTATE
        assert state(admin, table) == before
        with conn.cursor().copy(f"COPY {table} FROM STDIN") as copy:
            for i in range(ROWS):
                copy.write_row((ROWS + 1 + i, "a", 0))
    assert state(admin, table)[0] == ("a", 2 * ROWS, 0, 1, 2 * ROWS)


def test_insert_select_of_many_rows_needs_the_lock_of_every_row(
    admin: psycopg.Connection, table: str, template: str, pg_dsn: str
) -> None:
    before = state(admin, table)
    many = (
        f"INSERT INTO {table} SELECT g, CASE WHEN g = %s THEN %s ELSE 'a' END, 0"
        " FROM generate_series(%s::int, %s::int) g"
    )
    with try_lock(template.format(tenant_id="a"), dsn=pg_dsn) as lock:
        refused(lock.connection, many, (2 * ROWS, "b", ROWS + 1, 2 * ROWS))
        assert state(admin, table) == before
        lock.connection.execute(many, (2 * ROWS, "a", ROWS + 1, 2 * ROWS))
    assert state(admin, table)[0] == ("a", 2 * ROWS, 0, 1, 2 * ROWS)


def test_a_many_row_update_that_changes_the_name_needs_both_locks(
    admin: psycopg.Connection, table: str, template: str, pg_dsn: str
) -> None:
    move = f"UPDATE {table} SET tenant_id = 'c' WHERE tenant_id = 'a'"
    before = state(admin, table)
    for held, missing_one in (("a", "c"), ("c", "a")):
        with try_lock(template.format(tenant_id=held), dsn=pg_dsn) as lock:
            error = refused(lock.connection, move)
        assert f'"{template.format(tenant_id=missing_one)}"' in str(error)
        assert state(admin, table) == before
    with try_lock(template.format(tenant_id="a"), dsn=pg_dsn) as lock:
        with lock.connection.transaction():
            take_too(lock.connection, template.format(tenant_id="c"))
            lock.connection.execute(move)
    assert state(admin, table) == [("b", 1, 0, 0, 0), ("c", ROWS, 0, 1, ROWS)]


def test_on_conflict_do_update_needs_the_lock_of_the_row_it_updates(
    admin: psycopg.Connection, table: str, template: str, pg_dsn: str
) -> None:
    before = state(admin, table)
    with try_lock(template.format(tenant_id="a"), dsn=pg_dsn) as lock:
        # Id 0 is b's row: the conflict turns an INSERT of a's into an UPDATE of b's.
        refused(
            lock.connection,
            f"INSERT INTO {table} VALUES (0, 'a', 0), (-1, 'a', 0)"
            " ON CONFLICT (id) DO UPDATE SET n = jobs.n + 1",
        )
        refused(
            lock.connection,
            f"INSERT INTO {table} VALUES (0, 'a', 0)"
            " ON CONFLICT (id) DO UPDATE SET tenant_id = excluded.tenant_id",
        )
        assert state(admin, table) == before
        lock.connection.execute(
            f"INSERT INTO {table} VALUES (1, 'a', 0), (-1, 'a', 0)"
            " ON CONFLICT (id) DO UPDATE SET n = jobs.n + 1"
        )
    assert state(admin, table)[0] == ("a", ROWS + 1, 1, -1, ROWS)


def test_merge_needs_the_lock_of_every_row_it_touches(
    admin: psycopg.Connection, table: str, template: str, pg_dsn: str
) -> None:
    if admin.info.server_version < 150000:
        missing("MERGE came with PostgreSQL 15")
    merge = (
        f"MERGE INTO {table} AS j USING (VALUES (%s), (-1)) AS v (id) ON j.id = v.id"
        " WHEN MATCHED THEN UPDATE SET n = j.n + 1"
        " WHEN NOT MATCHED THEN INSERT VALUES (v.id, 'a', 0)"
    )
    before = state(admin, table)
    with try_lock(template.format(tenant_id="a"), dsn=pg_dsn) as lock:
        refused(lock.connection, merge, (0,))  # updates b's row
        refused(
            lock.connection,
            f"MERGE INTO {table} AS j USING (VALUES (0)) AS v (id)"
            " ON j.id = v.id WHEN MATCHED THEN DELETE",
        )
        assert state(admin, table) == before
        lock.connection.execute(merge, (1,))
    assert state(admin, table)[0] == ("a", ROWS + 1, 1, -1, ROWS)


def test_a_writable_cte_over_two_tenants_changes_nothing(
    admin: psycopg.Connection, table: str, template: str, pg_dsn: str
) -> None:
    before = state(admin, table)
    with try_lock(template.format(tenant_id="a"), dsn=pg_dsn) as lock:
        refused(
            lock.connection,
            f"WITH mine AS (UPDATE {table} SET n = n + 1 WHERE tenant_id = 'a' RETURNING id)"
            f" UPDATE {table} SET n = n + 1 WHERE tenant_id = 'b'",
        )
        refused(
            lock.connection,
            f"WITH gone AS (DELETE FROM {table} WHERE id = 0 RETURNING id)"
            f" INSERT INTO {table} VALUES (-1, 'a', 0)",
        )
    assert state(admin, table) == before


def test_a_write_through_a_view_is_checked_on_the_table(
    admin: psycopg.Connection, table: str, template: str, pg_dsn: str
) -> None:
    view = f"{table}_view"
    admin.execute(f"CREATE VIEW {view} AS SELECT * FROM {table} WHERE n >= 0")
    before = state(admin, table)
    with try_lock(template.format(tenant_id="a"), dsn=pg_dsn) as lock:
        refused(lock.connection, f"UPDATE {view} SET n = n + 1")
        refused(lock.connection, f"DELETE FROM {view} WHERE tenant_id = 'b'")
        assert state(admin, table) == before
        lock.connection.execute(f"UPDATE {view} SET n = n + 1 WHERE tenant_id = 'a'")
    assert state(admin, table)[0] == ("a", ROWS, ROWS, 1, ROWS)


@pytest.mark.parametrize(
    ("value", "bypass"), [("off", True), ("on", False), ("", False), ("nonsense", False)]
)
def test_only_the_off_switch_lets_a_whole_statement_through(
    admin: psycopg.Connection, plain: psycopg.Connection, table: str, value: str, bypass: bool
) -> None:
    before = state(admin, table)
    with plain.transaction(force_rollback=True):
        plain.execute("SELECT set_config('pglock.guard', %s, true)", (value,))
        if bypass:
            plain.execute(f"UPDATE {table} SET n = n + 1")
            plain.execute(f"INSERT INTO {table} VALUES (-1, 'z', 0)")
            plain.execute(f"DELETE FROM {table} WHERE tenant_id = 'b'")
        else:
            refused(plain, f"UPDATE {table} SET n = n + 1")
    assert state(admin, table) == before


def test_a_temporary_table_named_like_a_transition_table_is_not_read(
    admin: psycopg.Connection, table: str, template: str, pg_dsn: str
) -> None:
    """pg_temp is on the guard's search_path, but a transition table's name comes first."""
    before = state(admin, table)
    with try_lock(template.format(tenant_id="a"), dsn=pg_dsn) as lock:
        for forged in ("pglock_old_rows", "pglock_new_rows"):
            lock.connection.execute(f"CREATE TEMP TABLE {forged} (id int, tenant_id text, n int)")
            lock.connection.execute(f"INSERT INTO pg_temp.{forged} VALUES (1, 'a', 0)")
        refused(lock.connection, f"UPDATE {table} SET n = n + 1 WHERE tenant_id = 'b'")
        refused(lock.connection, f"DELETE FROM {table} WHERE tenant_id = 'b'")
        refused(lock.connection, f"INSERT INTO {table} VALUES (-1, 'b', 0)")
    assert state(admin, table) == before


# --- savepoints and the end of the transaction -------------------------------------------


def test_a_lock_taken_in_a_savepoint_rolled_back_proves_no_later_write(
    admin: psycopg.Connection, plain: psycopg.Connection, table: str, template: str
) -> None:
    """Rolling a savepoint back releases the transaction locks taken inside it."""
    bump = f"UPDATE {table} SET n = n + 1 WHERE tenant_id = 'a'"
    with plain.transaction():
        with plain.transaction(force_rollback=True):  # a savepoint, rolled back
            take_too(plain, template.format(tenant_id="a"))
            plain.execute(bump)  # proven: the lock is held, inside the savepoint
        with pytest.raises(psycopg.Error) as caught, plain.transaction():
            plain.execute(bump)  # the lock went with the savepoint: nothing proves it now
        assert caught.value.sqlstate == GUARD_SQLSTATE
    assert state(admin, table)[0][2] == 0


def test_the_holder_writes_again_after_a_savepoint_rolled_back(
    admin: psycopg.Connection, table: str, template: str, pg_dsn: str
) -> None:
    bump = f"UPDATE {table} SET n = n + 1 WHERE tenant_id = 'a'"
    with try_lock(template.format(tenant_id="a"), dsn=pg_dsn) as lock:
        conn = lock.connection
        with conn.transaction():
            with conn.transaction(force_rollback=True):
                conn.execute(bump)
            conn.execute(bump)  # the session lock is still held: proven afresh
            with conn.transaction():  # a savepoint released: its proof stays
                conn.execute(bump)
    assert state(admin, table)[0][2] == 2 * ROWS


def test_a_writer_that_lets_go_mid_transaction_keeps_others_out_until_it_ends(
    plain: psycopg.Connection, table: str, template: str, pg_dsn: str
) -> None:
    """The proof of a statement holds the lock (shared) until the transaction ends."""
    key = lock_key(template.format(tenant_id="a"))
    plain.execute("SELECT pg_advisory_lock(%s)", (key,))
    with psycopg.connect(pg_dsn, autocommit=True) as other:
        with plain.transaction():
            plain.execute(f"UPDATE {table} SET n = n + 1 WHERE tenant_id = 'a'")
            plain.execute("SELECT pg_advisory_unlock(%s)", (key,))
            took = other.execute("SELECT pg_try_advisory_lock(%s)", (key,)).fetchone()
            assert took == (False,)
        took = other.execute("SELECT pg_try_advisory_lock(%s)", (key,)).fetchone()
        assert took == (True,)
        other.execute("SELECT pg_advisory_unlock_all()")


# --- names told apart byte for byte ----------------------------------------------------------


@pytest.fixture
def case_blind(admin: psycopg.Connection, schema: str) -> str:
    """A collation under which 'a' = 'A' (ICU, nondeterministic)."""
    name = f"{schema}.case_blind"
    try:
        admin.execute(
            f"CREATE COLLATION {name} (provider = icu, locale = 'und-u-ks-level2',"
            " deterministic = false)"
        )
    except psycopg.errors.FeatureNotSupported as exc:
        missing(f"this Postgres has no ICU collations: {exc}")
    return name


@pytest.mark.parametrize("kind", ["plain", "partitioned", "partition"])
def test_names_a_collation_calls_equal_are_two_locks(
    admin: psycopg.Connection, schema: str, case_blind: str, template: str, pg_dsn: str, kind: str
) -> None:
    """'a' and 'A' are equal under the column's collation, yet name two locks."""
    table = f"{schema}.blind_{kind}"
    column = f"tenant_id text COLLATE {case_blind}"
    if kind == "partitioned":
        admin.execute(f"CREATE TABLE {table} ({column}, n int) PARTITION BY HASH (n)")
        admin.execute(
            f"CREATE TABLE {table}_0 PARTITION OF {table} FOR VALUES WITH (MODULUS 1, REMAINDER 0)"
        )
    elif kind == "partition":
        admin.execute(f"CREATE TABLE {table}_parent ({column}, n int) PARTITION BY HASH (n)")
        admin.execute(
            f"CREATE TABLE {table} PARTITION OF {table}_parent"
            " FOR VALUES WITH (MODULUS 1, REMAINDER 0)"
        )
    else:
        admin.execute(f"CREATE TABLE {table} ({column}, n int)")
    admin.execute(f"INSERT INTO {table} VALUES ('a', 0)")
    install_guard(admin, table, template)
    with try_lock(template.format(tenant_id="a"), dsn=pg_dsn) as lock:
        error = refused(lock.connection, f"UPDATE {table} SET tenant_id = 'A'")
        assert f'"{template.format(tenant_id="A")}"' in str(error)
        admin.execute(f"INSERT INTO {table} VALUES ('A', 0)")
        error = refused(lock.connection, f"UPDATE {table} SET n = n + 1")
        assert f'"{template.format(tenant_id="A")}"' in str(error)
        mine = f"UPDATE {table} SET n = n + 1 WHERE tenant_id = 'a' COLLATE \"C\""
        lock.connection.execute(mine)
    found = admin.execute(f'SELECT tenant_id COLLATE "C", n FROM {table} ORDER BY 1').fetchall()
    assert found == [("A", 0), ("a", 1)]


# --- which tables are checked by statement, and why they stay that way ----------------------


def test_a_plain_table_is_checked_by_statement_and_cannot_become_a_child_or_partition(
    admin: psycopg.Connection, plain: psycopg.Connection, table: str, template: str, schema: str
) -> None:
    """A statement naming a new parent would write its rows without its statement triggers."""
    assert trigger_levels(admin, table) == {
        "zz_pglock_guard": "STATEMENT",
        "zz_pglock_guard_delete": "STATEMENT",
        "zz_pglock_guard_stored_insert": "STATEMENT",
        "zz_pglock_guard_stored_update": "ROW",
        "zz_pglock_guard_truncate": "STATEMENT",
    }
    admin.execute(f"CREATE TABLE {schema}.parent (id int, tenant_id text NOT NULL, n int)")
    admin.execute(
        f"CREATE TABLE {schema}.parted (id int, tenant_id text NOT NULL, n int)"
        " PARTITION BY LIST (tenant_id)"
    )
    for attach in (
        f"ALTER TABLE {table} INHERIT {schema}.parent",
        f"ALTER TABLE {schema}.parted ATTACH PARTITION {table} FOR VALUES IN ('a', 'b')",
    ):
        with pytest.raises(psycopg.errors.FeatureNotSupported, match="zz_pglock_guard_stored"):
            admin.execute(attach)
    # The way around: remove the guard, attach, guard again, by row this time.
    remove_guard(admin, table)
    admin.execute(f"ALTER TABLE {schema}.parted ATTACH PARTITION {table} FOR VALUES IN ('a', 'b')")
    install_guard(admin, table, template)
    assert trigger_levels(admin, table) == {
        "zz_pglock_guard": "ROW",
        "zz_pglock_guard_stored_insert": "ROW",
        "zz_pglock_guard_stored_update": "ROW",
        "zz_pglock_guard_truncate": "STATEMENT",
    }
    refused(plain, f"UPDATE {schema}.parted SET n = n + 1")
    refused(plain, f"DELETE FROM {schema}.parted WHERE tenant_id = 'b'")


def test_partitions_are_checked_by_row_even_when_added_later(
    admin: psycopg.Connection, plain: psycopg.Connection, schema: str, template: str
) -> None:
    parted = f"{schema}.parted"
    admin.execute(f"CREATE TABLE {parted} (tenant_id text, n int) PARTITION BY LIST (tenant_id)")
    admin.execute(f"CREATE TABLE {parted}_a PARTITION OF {parted} FOR VALUES IN ('a')")
    install_guard(admin, parted, template)
    admin.execute(f"CREATE TABLE {parted}_b PARTITION OF {parted} FOR VALUES IN ('b')")
    admin.execute(f"INSERT INTO {parted} VALUES ('a', 0), ('b', 0)")
    assert trigger_levels(admin, parted)["zz_pglock_guard"] == "ROW"
    for target in (parted, f"{parted}_b"):
        refused(plain, f"UPDATE {target} SET n = n + 1")
        refused(plain, f"INSERT INTO {target} VALUES ('b', 1)")
        refused(plain, f"DELETE FROM {target}")
    assert admin.execute(f"SELECT count(*) FROM {parted}").fetchone() == (2,)


def test_a_disabled_delete_check_is_a_disabled_guard(
    admin: psycopg.Connection, table: str, template: str
) -> None:
    admin.execute(f"ALTER TABLE {table} DISABLE TRIGGER zz_pglock_guard_delete")
    assert [t.enabled for t in guarded_tables(admin) if t.table == table] == [False]
    install_guard(admin, table, template)
    assert [t.enabled for t in guarded_tables(admin) if t.table == table] == [True]


# --- a database guarded by the previous release ------------------------------------------------

#: What the previous release put on a table (its trigger function's body, template
#: "{prefix}{tenant_id}") and in public (the TRUNCATE function): row triggers only.
PREVIOUS_BODY = """
DECLARE
  held text;
  old_name text;
  new_name text;
  key bigint;
BEGIN
  IF pg_catalog.lower(pg_catalog.current_setting('pglock.guard', true)) IN ('off', 'false', 'no', '0') THEN
    IF TG_OP = 'DELETE' THEN RETURN OLD; END IF;
    RETURN NEW;
  END IF;
  held := coalesce(pg_catalog.current_setting('pglock.held', true), '');
  IF TG_OP <> 'INSERT' THEN
    old_name := '{prefix}' || coalesce(OLD."tenant_id"::text, 'None');
  END IF;
  IF TG_WHEN = 'BEFORE' THEN  -- UPDATE, DELETE: the row as it is stored now
    key := public.pglock_key(old_name);
    IF pg_catalog.strpos(held, ',' || key || ',') = 0 OR NOT pg_catalog.pg_try_advisory_xact_lock_shared(key) THEN
      PERFORM public.pglock_guard_check(TG_OP, TG_TABLE_SCHEMA, TG_TABLE_NAME, old_name, key);
    END IF;
    IF TG_OP = 'DELETE' THEN RETURN OLD; END IF;
    RETURN NEW;
  END IF;
  -- AFTER INSERT, UPDATE: the row as it was stored, once every BEFORE trigger ran.
  new_name := '{prefix}' || coalesce(NEW."tenant_id"::text, 'None');
  IF new_name IS DISTINCT FROM old_name THEN
    key := public.pglock_key(new_name);
    IF pg_catalog.strpos(held, ',' || key || ',') = 0 OR NOT pg_catalog.pg_try_advisory_xact_lock_shared(key) THEN
      PERFORM public.pglock_guard_check(TG_OP, TG_TABLE_SCHEMA, TG_TABLE_NAME, new_name, key);
    END IF;
  END IF;
  RETURN NULL;
END
"""  # noqa: E501
PREVIOUS_TRUNCATE = """
BEGIN
  IF pg_catalog.lower(pg_catalog.current_setting('pglock.guard', true)) IN ('off', 'false', 'no', '0') THEN
    RETURN NULL;
  END IF;
  RAISE EXCEPTION USING
    ERRCODE = 'PGL01',
    MESSAGE = pg_catalog.format('pglock guard: TRUNCATE of %I.%I refused: it would change '
      'every lock''s rows at once', TG_TABLE_SCHEMA, TG_TABLE_NAME),
    HINT = 'A migration or an operator can SET LOCAL pglock.guard = off first.';
END
"""  # noqa: E501


def guard_as_the_previous_release(admin: psycopg.Connection, table: str, template: str) -> None:
    """Give ``table`` (guarded now) the function and triggers the previous release made."""
    prefix = template.removesuffix("{tenant_id}")
    function = f"{table.split('.')[0]}.pglock_guard_{table.split('.')[1]}"
    for trigger in (
        "zz_pglock_guard",
        "zz_pglock_guard_delete",
        "zz_pglock_guard_stored_insert",
        "zz_pglock_guard_stored_update",
    ):
        admin.execute(f"DROP TRIGGER {trigger} ON {table}")
    body = PREVIOUS_BODY.replace("{prefix}", prefix)
    admin.execute(
        sql.SQL(
            "CREATE OR REPLACE FUNCTION {}() RETURNS trigger LANGUAGE plpgsql"
            " SET search_path = pg_catalog, pg_temp AS {}"
        ).format(sql.SQL(function), sql.Literal(body))
    )
    admin.execute(
        sql.SQL(
            "CREATE OR REPLACE FUNCTION public.pglock_guard_truncate() RETURNS trigger"
            " LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS {}"
        ).format(sql.Literal(PREVIOUS_TRUNCATE))
    )
    arg = sql.Literal(template).as_string(admin)
    admin.execute("SET search_path = pg_catalog, pg_temp")  # as install_guard does
    try:
        for create in (
            "zz_pglock_guard BEFORE UPDATE OR DELETE ON {t} FOR EACH ROW",
            "zz_pglock_guard_stored_insert AFTER INSERT ON {t} FOR EACH ROW",
            "zz_pglock_guard_stored_update AFTER UPDATE ON {t} FOR EACH ROW"
            " WHEN (NEW.tenant_id IS DISTINCT FROM OLD.tenant_id)",
        ):
            admin.execute(
                f"CREATE TRIGGER {create.format(t=table)} EXECUTE FUNCTION {function}({arg})"
            )
    finally:
        admin.execute("RESET search_path")


def behaves_as_a_guard(
    admin: psycopg.Connection, plain: psycopg.Connection, table: str, template: str, dsn: str
) -> None:
    before = state(admin, table)
    refused(plain, f"UPDATE {table} SET n = n + 1 WHERE tenant_id = 'a'")
    refused(plain, f"INSERT INTO {table} VALUES (-1, 'a', 0)")
    refused(plain, f"TRUNCATE {table}")
    assert state(admin, table) == before
    with try_lock(template.format(tenant_id="a"), dsn=dsn) as lock:
        with lock.connection.transaction(force_rollback=True):
            lock.connection.execute(f"UPDATE {table} SET n = n + 1 WHERE tenant_id = 'a'")
            lock.connection.execute(f"INSERT INTO {table} VALUES (-1, 'a', 0)")
            refused(lock.connection, f"DELETE FROM {table}")


def test_a_guard_of_the_previous_release_works_before_and_after_install_runs_again(
    admin: psycopg.Connection,
    plain: psycopg.Connection,
    table: str,
    template: str,
    schema: str,
    pg_dsn: str,
) -> None:
    guard_as_the_previous_release(admin, table, template)
    assert trigger_levels(admin, table)["zz_pglock_guard"] == "ROW"
    behaves_as_a_guard(admin, plain, table, template, pg_dsn)
    # Another table guarded by this release replaces the shared functions the old one calls.
    other = f"{schema}.other"
    admin.execute(f"CREATE TABLE {other} (tenant_id text, n int)")
    install_guard(admin, other, template)
    behaves_as_a_guard(admin, plain, table, template, pg_dsn)
    install_guard(admin, table, template)  # the upgrade
    assert trigger_levels(admin, table)["zz_pglock_guard"] == "STATEMENT"
    behaves_as_a_guard(admin, plain, table, template, pg_dsn)
    upgraded = admin.execute(
        "SELECT tgname, xmin::text FROM pg_trigger WHERE tgrelid = %s::regclass ORDER BY 1",
        (table,),
    ).fetchall()
    install_guard(admin, table, template)  # and now a no-op
    assert (
        admin.execute(
            "SELECT tgname, xmin::text FROM pg_trigger WHERE tgrelid = %s::regclass ORDER BY 1",
            (table,),
        ).fetchall()
        == upgraded
    )
