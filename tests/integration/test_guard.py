"""Guarded tables (G8) on a real Postgres: pglock_key() in SQL, who may write, and how not.

Every table lives in a schema of this module's own; every lock name carries the test's
run id, so that no other test's locks count.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import psycopg
import pytest
from celery import Celery
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from psycopg import sql

from pglock_celery import (
    ConfigurationError,
    LockTimeout,
    LockUnavailable,
    install_guard,
    lock_key,
    remove_guard,
    try_lock,
)
from pglock_celery.guard import GUARD_SQLSTATE, guarded_tables
from tests.apps import guarded
from tests.support.services import wait_until
from tests.support.workers import Worker
from tests.unit.test_keys import GOLDEN

TEMPLATE = "guard:{tenant_id}"


def texts(max_size: int) -> st.SearchStrategy[str]:
    """Any text Postgres can store (no NUL) and UTF-8 can encode (no lone surrogate)."""
    alphabet = st.characters(blacklist_categories=["Cs"], blacklist_characters="\x00")
    return st.text(alphabet, max_size=max_size)


#: Hypothesis keeps no example database in the work tree; Postgres round trips set the pace.
NO_DB: dict[str, Any] = {"database": None, "deadline": None}


@pytest.fixture(scope="module")
def admin(pg_dsn: str) -> Iterator[psycopg.Connection]:
    """A plain autocommit session that passes the guard (it turns it off for itself)."""
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("SET pglock.guard = off")
        yield conn


@pytest.fixture(scope="module")
def schema(admin: psycopg.Connection) -> Iterator[str]:
    name = f"guard_{uuid.uuid4().hex[:8]}"
    admin.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(name)))
    yield name
    admin.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(name)))


@pytest.fixture
def plain(pg_dsn: str) -> Iterator[psycopg.Connection]:
    """A session that takes no lock: application code that forgot it."""
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        yield conn


def new_table(admin: psycopg.Connection, schema: str, tenants: list[str]) -> str:
    table = f"{schema}.t_{uuid.uuid4().hex[:8]}"
    admin.execute(f"CREATE TABLE {table} (tenant_id text PRIMARY KEY, n integer NOT NULL)")
    for tenant in tenants:
        admin.execute(f"INSERT INTO {table} VALUES (%s, 0)", (tenant,))
    return table


@pytest.fixture
def tenants(run_id: str) -> list[str]:
    return [f"{run_id}-a", f"{run_id}-b", f"{run_id}-c"]


@pytest.fixture
def table(admin: psycopg.Connection, schema: str, tenants: list[str], pg_dsn: str) -> str:
    """A guarded table with one row (n = 0) per tenant."""
    name = new_table(admin, schema, tenants)
    install_guard(pg_dsn, name, TEMPLATE)
    return name


def lock_of(tenant: str) -> str:
    return TEMPLATE.format(tenant_id=tenant)


def rows(admin: psycopg.Connection, table: str) -> dict[str, int]:
    return dict(admin.execute(f"SELECT tenant_id, n FROM {table}").fetchall())  # type: ignore[arg-type]


def refused(conn: psycopg.Connection, statement: str, params: Any = None) -> psycopg.Error:
    with pytest.raises(psycopg.Error) as caught:
        conn.execute(statement, params)
    assert caught.value.sqlstate == GUARD_SQLSTATE, caught.value
    return caught.value


def bump(table: str) -> str:
    return f"UPDATE {table} SET n = n + 1 WHERE tenant_id = %s"


# --- 1. pglock_key() in SQL is lock_key() --------------------------------------------


@pytest.fixture(scope="module")
def keys_installed(admin: psycopg.Connection, schema: str) -> psycopg.Connection:
    install_guard(admin, new_table(admin, schema, []), TEMPLATE)
    return admin


def sql_key(conn: psycopg.Connection, name: str) -> int:
    row = conn.execute("SELECT pglock_key(%s)", (name,)).fetchone()
    assert row is not None
    return int(row[0])


@pytest.mark.parametrize(("name", "key"), GOLDEN.items())
def test_pglock_key_matches_the_golden_vectors(
    keys_installed: psycopg.Connection, name: str, key: int
) -> None:
    assert sql_key(keys_installed, name) == key == lock_key(name)


@pytest.mark.parametrize(
    "name", ["", "é", "日本語のテナント", "tenant:🎉", "e\u0301", "ß" * 300, "tab\tand\nnewline"]
)
def test_pglock_key_matches_lock_key_for_empty_and_non_ascii_names(
    keys_installed: psycopg.Connection, name: str
) -> None:
    assert sql_key(keys_installed, name) == lock_key(name)


@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow], **NO_DB)
@given(name=texts(80))
def test_pglock_key_matches_lock_key_for_random_strings(
    keys_installed: psycopg.Connection, name: str
) -> None:
    assert sql_key(keys_installed, name) == lock_key(name)


def python_key_of_prefix(prefix: str) -> int:
    digest = mock.Mock(hexdigest=mock.Mock(return_value=prefix + "0" * 16))
    with mock.patch("pglock_celery.keys.hashlib.md5", return_value=digest):
        return lock_key("anything")


@pytest.mark.parametrize(
    ("prefix", "key"),
    [
        ("ffffffffffffffff", -(2**63)),  # 2**63: the one digest that wraps
        ("fffffffffffffffe", 2**63 - 1),
        ("8000000000000000", 1),
        ("7fffffffffffffff", 0),
        ("0000000000000000", -(2**63 - 1)),
    ],
)
def test_the_sql_offset_arithmetic_wraps_the_overflow_digest(
    keys_installed: psycopg.Connection, prefix: str, key: int
) -> None:
    row = keys_installed.execute("SELECT pglock_key_from_hex(%s)", (prefix,)).fetchone()
    assert row is not None
    assert row[0] == key == python_key_of_prefix(prefix)


@settings(max_examples=200, **NO_DB)
@given(prefix=st.text("0123456789abcdef", min_size=16, max_size=16))
def test_the_sql_offset_arithmetic_matches_python_for_any_digest(
    keys_installed: psycopg.Connection, prefix: str
) -> None:
    row = keys_installed.execute("SELECT pglock_key_from_hex(%s)", (prefix,)).fetchone()
    assert row is not None and row[0] == python_key_of_prefix(prefix)


def test_pglock_key_is_immutable_and_inlined(keys_installed: psycopg.Connection) -> None:
    volatility = keys_installed.execute(
        "SELECT provolatile FROM pg_proc WHERE oid = 'public.pglock_key(text)'::regprocedure"
    ).fetchone()
    assert volatility == ("i",)
    plan = keys_installed.execute("EXPLAIN VERBOSE SELECT pglock_key(relname) FROM pg_class")
    text = "\n".join(line for (line,) in plan.fetchall())
    assert "md5(" in text and "pglock_key" not in text  # no function call per row


# --- 2. who may write ----------------------------------------------------------------


@pytest.mark.parametrize("op", ["insert", "update", "delete"])
def test_a_write_without_the_lock_is_refused_and_changes_nothing(
    admin: psycopg.Connection, plain: psycopg.Connection, table: str, tenants: list[str], op: str
) -> None:
    before = rows(admin, table)
    statement = {
        "insert": f"INSERT INTO {table} VALUES (%s || '-new', 0)",
        "update": bump(table),
        "delete": f"DELETE FROM {table} WHERE tenant_id = %s",
    }[op]
    error = refused(plain, statement, (tenants[0],))
    assert rows(admin, table) == before
    expected = f"{tenants[0]}-new" if op == "insert" else tenants[0]
    assert f'the lock "{lock_of(expected)}"' in str(error)


def test_the_refusal_names_the_table_the_lock_and_the_fix(
    plain: psycopg.Connection, table: str, tenants: list[str]
) -> None:
    error = refused(plain, bump(table), (tenants[0],))
    first = str(error).splitlines()[0]
    assert first == (
        f"pglock guard: UPDATE on {table} refused: this session does not hold the lock"
        f' "{lock_of(tenants[0])}"'
    )
    key = lock_key(lock_of(tenants[0]))
    assert error.diag.message_detail == f"The lock's key is {key}; no session holds it."
    hint = error.diag.message_hint or ""
    assert f"try_lock('{lock_of(tenants[0])}').connection" in hint
    assert "current_lock().connection" in hint and "SET LOCAL pglock.guard = off" in hint
    assert isinstance(error, psycopg.ProgrammingError)


def test_another_tenants_lock_does_not_count(
    admin: psycopg.Connection, table: str, tenants: list[str], pg_dsn: str
) -> None:
    with try_lock(lock_of(tenants[1]), dsn=pg_dsn) as lock:
        assert lock.acquired
        refused(lock.connection, bump(table), (tenants[0],))
    assert rows(admin, table)[tenants[0]] == 0


def test_a_lock_held_by_another_session_does_not_count(
    admin: psycopg.Connection,
    plain: psycopg.Connection,
    table: str,
    tenants: list[str],
    pg_dsn: str,
) -> None:
    with try_lock(lock_of(tenants[0]), dsn=pg_dsn) as lock:
        assert lock.acquired
        holder_pid = lock.connection.info.backend_pid
        error = refused(plain, bump(table), (tenants[0],))
        # The same key in this session's pglock.held (set by hand) proves nothing either.
        plain.execute("SELECT set_config('pglock.held', %s, false)", (f",{lock.key},",))
        refused(plain, bump(table), (tenants[0],))
    assert f"the session of backend pid {holder_pid} holds it" in str(error)
    assert rows(admin, table)[tenants[0]] == 0


def test_a_hand_rolled_lock_released_before_the_write_does_not_count(
    admin: psycopg.Connection, plain: psycopg.Connection, table: str, tenants: list[str]
) -> None:
    key = lock_key(lock_of(tenants[0]))
    plain.execute("SELECT pg_advisory_lock(%s)", (key,))
    plain.execute("SELECT pg_advisory_unlock(%s)", (key,))
    refused(plain, bump(table), (tenants[0],))
    assert rows(admin, table)[tenants[0]] == 0


def test_the_lock_sessions_connection_cannot_write_after_release(
    admin: psycopg.Connection, table: str, tenants: list[str], pg_dsn: str
) -> None:
    with try_lock(lock_of(tenants[0]), dsn=pg_dsn) as lock:
        assert lock.acquired
        raw = lock.connection  # a handle kept past the block, as a careless body might
    with pytest.raises(psycopg.Error):  # refused by the guard, or a dead handle (G7)
        raw.execute(bump(table), (tenants[0],))
    assert rows(admin, table)[tenants[0]] == 0


def test_a_multi_row_update_touching_one_unlocked_row_changes_nothing(
    admin: psycopg.Connection, table: str, tenants: list[str], pg_dsn: str
) -> None:
    with try_lock(lock_of(tenants[0]), dsn=pg_dsn) as lock:
        assert lock.acquired
        refused(lock.connection, f"UPDATE {table} SET n = n + 1")
    assert set(rows(admin, table).values()) == {0}


def test_writes_through_the_holders_own_connection_commit(
    admin: psycopg.Connection, table: str, tenants: list[str], pg_dsn: str
) -> None:
    new = f"{tenants[0]}-new"
    with try_lock(lock_of(new), dsn=pg_dsn) as lock:
        assert lock.acquired
        lock.connection.execute(f"INSERT INTO {table} VALUES (%s, 0)", (new,))
        with lock.connection.transaction():
            lock.connection.execute(bump(table), (new,))
    with try_lock(lock_of(tenants[0]), dsn=pg_dsn) as lock:
        lock.connection.execute(f"DELETE FROM {table} WHERE tenant_id = %s", (tenants[0],))
    assert rows(admin, table) == {new: 1, tenants[1]: 0, tenants[2]: 0}


def test_a_hand_rolled_holder_commits(
    admin: psycopg.Connection, plain: psycopg.Connection, table: str, tenants: list[str]
) -> None:
    """Code from the original write-up: pg_advisory_lock on a plain session, no library."""
    plain.execute("SELECT pg_advisory_lock(%s)", (lock_key(lock_of(tenants[0])),))
    try:
        plain.execute(bump(table), (tenants[0],))
    finally:
        plain.execute("SELECT pg_advisory_unlock_all()")
    assert rows(admin, table)[tenants[0]] == 1


def slow_path_calls(conn: psycopg.Connection, statement: str, params: Any) -> int:
    """Run ``statement`` and count its calls of the pg_locks path.

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
        conn.execute(statement, params)
        after = conn.execute(calls).fetchone()
    assert before is not None and after is not None
    return int(after[0]) - int(before[0])


def test_a_library_holder_never_reads_pg_locks_a_hand_rolled_one_does(
    plain: psycopg.Connection, table: str, tenants: list[str], pg_dsn: str
) -> None:
    with try_lock(lock_of(tenants[0]), dsn=pg_dsn) as lock:
        assert slow_path_calls(lock.connection, bump(table), (tenants[0],)) == 0
    plain.execute("SELECT pg_advisory_lock(%s)", (lock_key(lock_of(tenants[1])),))
    try:
        assert slow_path_calls(plain, bump(table), (tenants[1],)) == 1
    finally:
        plain.execute("SELECT pg_advisory_unlock_all()")


def test_an_update_that_changes_the_lock_name_needs_both_locks(
    admin: psycopg.Connection, table: str, tenants: list[str], pg_dsn: str
) -> None:
    old, new = tenants[0], f"{tenants[0]}-moved"
    move = f"UPDATE {table} SET tenant_id = %s WHERE tenant_id = %s"
    for held in (old, new):
        with try_lock(lock_of(held), dsn=pg_dsn) as lock:
            error = refused(lock.connection, move, (new, old))
        other = new if held == old else old
        assert f'"{lock_of(other)}"' in str(error)
    with try_lock(lock_of(old), dsn=pg_dsn) as lock, lock.connection.transaction():
        # The second lock for this transaction only, on the same session.
        lock.connection.execute("SELECT pg_advisory_xact_lock(%s)", (lock_key(lock_of(new)),))
        lock.connection.execute(move, (new, old))
    assert new in rows(admin, table) and old not in rows(admin, table)


def test_truncate_is_refused_unless_the_guard_is_off(
    admin: psycopg.Connection, plain: psycopg.Connection, table: str
) -> None:
    error = refused(plain, f"TRUNCATE {table}")
    assert "TRUNCATE" in str(error)
    assert len(rows(admin, table)) == 3
    admin.execute(f"TRUNCATE {table}")
    assert rows(admin, table) == {}


@pytest.mark.parametrize("value", ["off", "OFF", "false", "0"])
def test_set_local_bypass_lasts_one_transaction(
    admin: psycopg.Connection, plain: psycopg.Connection, table: str, tenants: list[str], value: str
) -> None:
    with plain.transaction():
        plain.execute(f"SET LOCAL pglock.guard = {value}")
        plain.execute(bump(table), (tenants[0],))
        plain.execute(f"DELETE FROM {table} WHERE tenant_id = %s", (tenants[1],))
    refused(plain, bump(table), (tenants[0],))
    assert rows(admin, table) == {tenants[0]: 1, tenants[2]: 0}


def test_a_session_bypass_lasts_until_reset(
    admin: psycopg.Connection, plain: psycopg.Connection, table: str, tenants: list[str]
) -> None:
    plain.execute("SET pglock.guard = off")
    plain.execute(bump(table), (tenants[0],))
    plain.execute(bump(table), (tenants[0],))
    plain.execute("SET pglock.guard = on")
    refused(plain, bump(table), (tenants[0],))
    plain.execute("SET pglock.guard = off")
    plain.execute("RESET pglock.guard")
    refused(plain, bump(table), (tenants[0],))
    assert rows(admin, table)[tenants[0]] == 2


# --- lock names of every supported column type, as str.format makes them -------------

TYPED_TEMPLATE = "k:{t}|{v}|{s}|{i}|{b}|{u}"


@pytest.fixture(scope="module")
def typed_table(admin: psycopg.Connection, schema: str) -> str:
    table = f"{schema}.typed_{uuid.uuid4().hex[:8]}"
    admin.execute(
        f"CREATE TABLE {table} (t text, v varchar(200), s smallint, i integer, b bigint, u uuid)"
    )
    install_guard(admin, table, TYPED_TEMPLATE)
    return table


def values(some: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(st.none(), some)


@settings(max_examples=60, **NO_DB)
@given(
    row=st.fixed_dictionaries(
        {
            "t": values(texts(20)),
            "v": values(texts(20)),
            "s": values(st.integers(-(2**15), 2**15 - 1)),
            "i": values(st.integers(-(2**31), 2**31 - 1)),
            "b": values(st.integers(-(2**63), 2**63 - 1)),
            "u": values(st.uuids()),
        }
    )
)
def test_a_rows_lock_name_is_what_str_format_makes_of_the_values(
    typed_table: str, pg_dsn: str, row: dict[str, Any]
) -> None:
    """text, varchar, smallint, integer, bigint, uuid, and NULL as None."""
    name = TYPED_TEMPLATE.format(**row)
    insert = f"INSERT INTO {typed_table} VALUES (%(t)s, %(v)s, %(s)s, %(i)s, %(b)s, %(u)s)"
    with try_lock(name, dsn=pg_dsn) as lock:
        assert lock.acquired
        with lock.connection.transaction(force_rollback=True):
            lock.connection.execute(insert, row)


# --- a state machine: sessions that lock, unlock, turn the guard off and write --------


class GuardMachine(RuleBasedStateMachine):
    """Invariant: a write commits exactly when its session holds the row's lock, or has
    the guard off. Writers: two plain sessions (hand-rolled locks) and library locks."""

    TENANTS = ("m0", "m1")
    dsn = ""
    table = ""

    def __init__(self) -> None:
        super().__init__()
        self.reader = psycopg.connect(self.dsn, autocommit=True)
        self.plain = [psycopg.connect(self.dsn, autocommit=True) for _ in range(2)]
        self.hand: list[dict[str, int]] = [{}, {}]  # per plain session: tenant -> depth
        self.bypass = [False, False]
        self.library: dict[str, Any] = {}  # tenant -> held AdvisoryLock
        self.n = dict.fromkeys(self.TENANTS, 0)
        self.reader.execute("SET pglock.guard = off")
        self.reader.execute(f"UPDATE {self.table} SET n = 0")

    def name(self, tenant: str) -> str:
        return lock_of(tenant)

    def held_elsewhere(self, tenant: str, me: int | None) -> bool:
        hand = any(self.hand[s].get(tenant) for s in range(2) if s != me)
        return hand or tenant in self.library

    @rule(s=st.integers(0, 1), tenant=st.sampled_from(TENANTS))
    def hand_lock(self, s: int, tenant: str) -> None:
        row = (
            self.plain[s]
            .execute("SELECT pg_try_advisory_lock(%s)", (lock_key(self.name(tenant)),))
            .fetchone()
        )
        assert row is not None
        assert row[0] == (not self.held_elsewhere(tenant, s))
        if row[0]:
            self.hand[s][tenant] = self.hand[s].get(tenant, 0) + 1

    @rule(s=st.integers(0, 1), tenant=st.sampled_from(TENANTS))
    def hand_unlock(self, s: int, tenant: str) -> None:
        if self.hand[s].get(tenant):
            self.plain[s].execute("SELECT pg_advisory_unlock(%s)", (lock_key(self.name(tenant)),))
            self.hand[s][tenant] -= 1

    @rule(tenant=st.sampled_from(TENANTS))
    def library_lock(self, tenant: str) -> None:
        if tenant in self.library:
            return
        lock = try_lock(self.name(tenant), dsn=self.dsn)
        lock.__enter__()
        assert lock.acquired == (not self.held_elsewhere(tenant, None))
        if lock.acquired:
            self.library[tenant] = lock
        else:
            lock.__exit__(None, None, None)

    @precondition(lambda self: bool(self.library))
    @rule(data=st.data())
    def library_release(self, data: st.DataObject) -> None:
        tenant = data.draw(st.sampled_from(sorted(self.library)))
        self.library.pop(tenant).__exit__(None, None, None)

    @rule(s=st.integers(0, 1), off=st.booleans())
    def set_bypass(self, s: int, off: bool) -> None:
        self.plain[s].execute(f"SET pglock.guard = {'off' if off else 'on'}")
        self.bypass[s] = off

    @rule(s=st.integers(0, 1), tenant=st.sampled_from(TENANTS))
    def plain_write(self, s: int, tenant: str) -> None:
        allowed = self.bypass[s] or bool(self.hand[s].get(tenant))
        self.write(self.plain[s], tenant, allowed)

    @precondition(lambda self: bool(self.library))
    @rule(data=st.data(), tenant=st.sampled_from(TENANTS))
    def library_write(self, data: st.DataObject, tenant: str) -> None:
        writer = data.draw(st.sampled_from(sorted(self.library)))
        self.write(self.library[writer].connection, tenant, allowed=writer == tenant)

    @rule(s=st.integers(0, 1))
    def plain_write_every_tenant(self, s: int) -> None:
        """One statement over both tenants' rows: it needs both locks."""
        allowed = self.bypass[s] or all(self.hand[s].get(t) for t in self.TENANTS)
        self.write(self.plain[s], None, allowed)

    @precondition(lambda self: bool(self.library))
    @rule(data=st.data())
    def library_write_every_tenant(self, data: st.DataObject) -> None:
        writer = data.draw(st.sampled_from(sorted(self.library)))
        self.write(self.library[writer].connection, None, allowed=False)  # one lock each

    def write(self, conn: psycopg.Connection, tenant: str | None, allowed: bool) -> None:
        """Bump ``tenant``'s row, or every row in one statement (None)."""
        statement = bump(self.table) if tenant else f"UPDATE {self.table} SET n = n + 1"
        try:
            conn.execute(statement, (tenant,) if tenant else None)
        except psycopg.Error as exc:
            assert exc.sqlstate == GUARD_SQLSTATE
            assert not allowed, f"refused a write the session may make: {exc}"
        else:
            assert allowed, "a write without the lock committed"
            for written in [tenant] if tenant else self.TENANTS:
                self.n[written] += 1

    @invariant()
    def table_shows_exactly_the_allowed_writes(self) -> None:
        found = self.reader.execute(f"SELECT tenant_id, n FROM {self.table}").fetchall()
        assert dict(found) == self.n  # type: ignore[arg-type]

    def teardown(self) -> None:
        for lock in self.library.values():
            lock.__exit__(None, None, None)
        for conn in [*self.plain, self.reader]:
            conn.close()


def test_writes_commit_exactly_when_the_session_holds_the_lock_or_bypasses(
    admin: psycopg.Connection, schema: str, pg_dsn: str
) -> None:
    table = new_table(admin, schema, list(GuardMachine.TENANTS))
    install_guard(admin, table, TEMPLATE)
    GuardMachine.dsn, GuardMachine.table = pg_dsn, table
    machine = GuardMachine.TestCase()
    machine.settings = settings(max_examples=40, stateful_step_count=25, **NO_DB)
    machine.runTest()


# --- 4. install, remove, bad input ---------------------------------------------------


def guard_objects(admin: psycopg.Connection, table: str) -> list[tuple[Any, ...]]:
    """The table's triggers and trigger functions, with row versions (xmin)."""
    return admin.execute(
        "SELECT t.tgname, t.xmin::text, p.proname, p.xmin::text FROM pg_trigger t"
        " JOIN pg_proc p ON p.oid = t.tgfoid WHERE t.tgrelid = %s::regclass ORDER BY 1",
        (table,),
    ).fetchall()


def test_install_again_is_a_no_op_that_takes_no_lock_on_a_busy_table(
    admin: psycopg.Connection, table: str, tenants: list[str], pg_dsn: str
) -> None:
    before = guard_objects(admin, table)
    assert [row[0] for row in before] == [
        "zz_pglock_guard",
        "zz_pglock_guard_delete",
        "zz_pglock_guard_stored_insert",
        "zz_pglock_guard_stored_update",
        "zz_pglock_guard_truncate",
    ]
    with psycopg.connect(pg_dsn) as busy:  # a writer in a long transaction
        busy.execute("SET LOCAL pglock.guard = off")
        busy.execute(bump(table), (tenants[0],))
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute("SET lock_timeout = '500ms'")
            install_guard(conn, table, TEMPLATE)
        busy.rollback()
    assert guard_objects(admin, table) == before


def test_install_on_a_busy_table_gives_up_after_the_lock_timeout(
    admin: psycopg.Connection, table: str, tenants: list[str], pg_dsn: str
) -> None:
    with psycopg.connect(pg_dsn) as busy:
        busy.execute("SET LOCAL pglock.guard = off")
        busy.execute(bump(table), (tenants[0],))
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute("SET lock_timeout = '200ms'")
            with pytest.raises(LockTimeout, match="busy"):
                install_guard(conn, table, "other:{tenant_id}")
        busy.rollback()
    assert [t.lock_name for t in guarded_tables(admin) if t.table == table] == [TEMPLATE]


def test_install_with_another_template_replaces_the_guard_in_place(
    admin: psycopg.Connection,
    plain: psycopg.Connection,
    table: str,
    tenants: list[str],
    pg_dsn: str,
) -> None:
    install_guard(pg_dsn, table, "other:{tenant_id}")
    assert [t.lock_name for t in guarded_tables(admin) if t.table == table] == ["other:{tenant_id}"]
    with try_lock(lock_of(tenants[0]), dsn=pg_dsn) as lock:
        refused(lock.connection, bump(table), (tenants[0],))
    with try_lock(f"other:{tenants[0]}", dsn=pg_dsn) as lock:
        lock.connection.execute(bump(table), (tenants[0],))
    assert rows(admin, table)[tenants[0]] == 1
    assert len(guard_objects(admin, table)) == 5


def test_a_disabled_guard_is_listed_so_and_enabled_again_by_install(
    admin: psycopg.Connection,
    plain: psycopg.Connection,
    table: str,
    tenants: list[str],
    pg_dsn: str,
) -> None:
    admin.execute(f"ALTER TABLE {table} DISABLE TRIGGER zz_pglock_guard")
    assert [t.enabled for t in guarded_tables(admin) if t.table == table] == [False]
    install_guard(pg_dsn, table, TEMPLATE)
    assert [t.enabled for t in guarded_tables(admin) if t.table == table] == [True]
    refused(plain, bump(table), (tenants[0],))


def test_remove_restores_plain_behaviour_and_is_idempotent(
    admin: psycopg.Connection,
    plain: psycopg.Connection,
    table: str,
    tenants: list[str],
    pg_dsn: str,
) -> None:
    remove_guard(pg_dsn, table)
    plain.execute(bump(table), (tenants[0],))
    plain.execute(f"TRUNCATE {table}")
    assert rows(admin, table) == {}
    assert guard_objects(admin, table) == []
    assert table not in [t.table for t in guarded_tables(admin)]
    leftover = admin.execute(
        "SELECT count(*) FROM pg_proc WHERE proname = %s", (f"pglock_guard_{table.split('.')[1]}",)
    ).fetchone()
    assert leftover == (0,)
    remove_guard(pg_dsn, table)
    assert sql_key(admin, "tenant:42") == lock_key("tenant:42")  # pglock_key() stays


def test_install_inside_a_callers_transaction_commits_or_rolls_back_with_it(
    admin: psycopg.Connection, schema: str, pg_dsn: str, plain: psycopg.Connection
) -> None:
    """A migration: the guard is part of the migration's own transaction."""
    table = new_table(admin, schema, ["x"])
    with psycopg.connect(pg_dsn) as migration:
        migration.execute("SELECT 1")  # the migration's transaction is open
        install_guard(migration, table, TEMPLATE)
        migration.rollback()
        plain.execute(bump(table), ("x",))  # not guarded: rolled back
        migration.execute("SELECT 1")
        install_guard(migration, table, TEMPLATE)
        migration.commit()
    refused(plain, bump(table), ("x",))


@pytest.mark.parametrize(
    ("make", "template", "says"),
    [
        ("", "guard:{tenant_id}", "no table"),
        ("(tenant_id text)", "guard:{tenant}", r"names \{tenant\}, which is not a column"),
        ("(tenant_id text)", "guard:{tenant_id.x}", "plain column name"),
        ("(at timestamptz)", "guard:{at}", "timestamp with time zone"),
        ("(n numeric)", "guard:{n}", "numeric"),
        ("(a int, g int GENERATED ALWAYS AS (a) STORED)", "guard:{g}", "generated column"),
        ("view", "guard:{tenant_id}", "is not a table"),
    ],
)
def test_bad_input_is_a_configuration_error_before_anything_changes(
    admin: psycopg.Connection, schema: str, pg_dsn: str, make: str, template: str, says: str
) -> None:
    name = f"{schema}.bad_{uuid.uuid4().hex[:8]}"
    if make == "view":
        admin.execute(f"CREATE VIEW {name} AS SELECT 'x'::text AS tenant_id")
    elif make:
        admin.execute(f"CREATE TABLE {name} {make}")
    functions = admin.execute("SELECT count(*) FROM pg_proc").fetchone()
    with pytest.raises(ConfigurationError, match=says):
        install_guard(pg_dsn, name, template)
    assert admin.execute("SELECT count(*) FROM pg_proc").fetchone() == functions
    assert name not in [t.table for t in guarded_tables(admin)]


def test_a_domain_over_text_is_a_text_column(admin: psycopg.Connection, schema: str) -> None:
    domain = f"{schema}.tenant_key_{uuid.uuid4().hex[:6]}"
    admin.execute(f"CREATE DOMAIN {domain} AS text CHECK (VALUE <> '')")
    table = new_table(admin, schema, [])
    admin.execute(f"ALTER TABLE {table} ADD COLUMN region {domain}")
    install_guard(admin, table, "guard:{region}/{tenant_id}")
    assert "guard:{region}/{tenant_id}" in [t.lock_name for t in guarded_tables(admin)]


def test_connection_failures_are_pglock_errors_without_the_password() -> None:
    with pytest.raises(LockUnavailable, match="cannot connect") as caught:
        install_guard("postgresql://app:s3cret-pw@127.0.0.1:1/db", "t", TEMPLATE)
    assert "s3cret-pw" not in str(caught.value)
    with pytest.raises(ConfigurationError, match="not a valid connection string") as bad:
        remove_guard("host=127.0.0.1 password=s3cret-pw bogus", "t")
    assert "s3cret-pw" not in str(bad.value)


# --- 3. real workers: a lost lock cannot commit, another connection cannot write -------


@pytest.fixture(scope="module")
def guard_worker(
    app: Celery, worker_env: dict[str, str], log_dir: Path
) -> Iterator[dict[str, str]]:
    queue = f"pglock-guard-{uuid.uuid4().hex[:8]}"
    worker = Worker(
        app, "tests.apps.guarded", {**worker_env, "PGLOCK_TEST_QUEUE": queue}, log_dir,
        concurrency=1,
    )  # fmt: skip
    try:
        yield {"queue": queue}
    finally:
        worker.stop()


def test_a_body_writing_through_another_connection_is_refused(
    guard_worker: dict[str, str], admin: psycopg.Connection, schema: str, run_id: str
) -> None:
    table = new_table(admin, schema, [run_id])
    install_guard(admin, table, guarded.GUARD_LOCK)
    call = guarded.guarded_write.apply_async((run_id, table, "other"), queue=guard_worker["queue"])
    assert call.get(timeout=60) == GUARD_SQLSTATE
    assert rows(admin, table) == {run_id: 0}
    call = guarded.guarded_write.apply_async((run_id, table, "lock"), queue=guard_worker["queue"])
    assert call.get(timeout=60) == "committed"
    assert rows(admin, table) == {run_id: 1}


def test_a_worker_whose_lock_session_was_terminated_mid_step_cannot_commit(
    guard_worker: dict[str, str],
    admin: psycopg.Connection,
    schema: str,
    run_id: str,
    app: Celery,
    pg_dsn: str,
) -> None:
    table = new_table(admin, schema, [run_id])
    install_guard(admin, table, guarded.GUARD_LOCK)
    client = app.backend.client
    signal_key = f"pglock-guard-test:{run_id}"
    call = guarded.write_across_a_kill.apply_async(
        (run_id, table, signal_key), queue=guard_worker["queue"]
    )
    pid = int(wait_until(lambda: client.get(f"{signal_key}:pid"), 60, "the step's update"))
    admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
    gone = "SELECT NOT EXISTS (SELECT FROM pg_stat_activity WHERE pid = %s)"
    wait_until(lambda: admin.execute(gone, (pid,)).fetchone() == (True,), 10, "the session to end")
    # The lock is free at once: another holder takes it while the step still runs.
    with try_lock(guarded.GUARD_LOCK.format(tenant_id=run_id), dsn=pg_dsn) as successor:
        assert successor.acquired
        client.set(f"{signal_key}:killed", 1)
        wait_until(lambda: client.exists(f"{signal_key}:outcome"), 60, "the step's outcome")
    outcome = {k.decode(): v.decode() for k, v in client.hgetall(f"{signal_key}:outcome").items()}
    assert outcome["commit"].startswith("failed")
    assert outcome["fresh"] == GUARD_SQLSTATE
    assert rows(admin, table) == {run_id: 0}
    call.get(timeout=60, propagate=False)
    assert call.state == "FAILURE"  # LockLost at release
    client.delete(f"{signal_key}:pid", f"{signal_key}:killed", f"{signal_key}:outcome")


# --- the orchestrator guards its own tables --------------------------------------------


def test_the_orchestrator_guards_its_tables_with_its_steps_lock(pg_dsn: str) -> None:
    from tasks.pipeline import advance_pipeline
    from tasks.run import prepare_database
    from tasks.schema import GUARDED_TABLES, PIPELINE_LOCK, apply_schema
    from tasks.tenants import seed_tenants

    assert advance_pipeline.lock_name == PIPELINE_LOCK
    schema = f"orch_guard_{uuid.uuid4().hex[:8]}"
    dsn = prepare_database(pg_dsn, schema)
    try:
        apply_schema(dsn)
        apply_schema(dsn)  # init-db again: nothing changes
        seed_tenants(dsn, ["t1", "t2"])  # onboarding writes pipelines under each tenant's lock
        with psycopg.connect(dsn, autocommit=True) as conn:
            shown = {t.table: t.lock_name for t in guarded_tables(conn)}
            assert {shown.get(f"{schema}.{table}") for table in GUARDED_TABLES} == {PIPELINE_LOCK}
            refused(conn, "UPDATE pipelines SET attempts = 1 WHERE tenant_id = 't1'")
        with try_lock("training:t1", dsn=dsn) as lock:
            lock.connection.execute("UPDATE pipelines SET attempts = 1 WHERE tenant_id = 't1'")
    finally:
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(schema)))


def test_a_partitioned_table_is_listed_once_and_its_partitions_are_guarded(
    admin: psycopg.Connection, schema: str, plain: psycopg.Connection, run_id: str
) -> None:
    parent = f"{schema}.parted_{run_id}"
    admin.execute(f"CREATE TABLE {parent} (tenant_id text, n int) PARTITION BY LIST (tenant_id)")
    admin.execute(f"CREATE TABLE {parent}_a PARTITION OF {parent} FOR VALUES IN ('a')")
    install_guard(admin, parent, TEMPLATE)
    assert [t.table for t in guarded_tables(admin) if t.table.startswith(parent)] == [parent]
    refused(plain, f"INSERT INTO {parent}_a VALUES ('a', 0)")
    assert admin.execute(f"SELECT count(*) FROM {parent}").fetchone() == (0,)


def test_the_guard_sees_the_row_as_the_tables_other_before_triggers_left_it(
    admin: psycopg.Connection, schema: str, tenants: list[str], pg_dsn: str
) -> None:
    """A trigger that rewrites the tenant cannot carry a write past the guard."""
    table = new_table(admin, schema, [])
    admin.execute(
        f"CREATE FUNCTION {table}_retarget() RETURNS trigger LANGUAGE plpgsql AS"
        f" $$BEGIN NEW.tenant_id := '{tenants[1]}'; RETURN NEW; END$$"
    )
    admin.execute(
        f"CREATE TRIGGER set_tenant BEFORE INSERT ON {table}"
        f" FOR EACH ROW EXECUTE FUNCTION {table}_retarget()"
    )
    install_guard(admin, table, TEMPLATE)
    with try_lock(lock_of(tenants[0]), dsn=pg_dsn) as lock:
        error = refused(lock.connection, f"INSERT INTO {table} VALUES (%s, 0)", (tenants[0],))
    assert f'"{lock_of(tenants[1])}"' in str(error)
    assert rows(admin, table) == {}
