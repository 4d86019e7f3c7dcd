"""Guarded tables: Postgres refuses a write to a row unless the writing session holds its lock.

``install_guard(conn_or_dsn, "pipelines", "training:{tenant_id}")`` puts triggers on the
table that build each written row's lock name from the template over its columns,
compute its key with ``pglock_key()`` and raise (SQLSTATE ``PGL01``) unless this session
holds that lock. The template is every trigger's argument, so ``\\d pipelines`` shows it
and ``guarded_tables()`` reads it back. The checks come in two layouts:

- **By statement**, on a plain table (not a partition): AFTER INSERT, UPDATE and DELETE
  statement triggers (``zz_pglock_guard_stored_insert``,
  ``zz_pglock_guard``, ``zz_pglock_guard_delete``) read the statement's rows from its
  transition table (the new rows as stored, once every BEFORE trigger has run; the old
  rows) and check each distinct lock name once, so a 10,000-row UPDATE of one tenant
  computes one key, not 10,000. They fire at the end of their statement and abort it, so
  a refused row is never stored. The only writes that would not fire them name a parent
  of the table, and it can get none: ``zz_pglock_guard_stored_update`` is a row trigger
  with a transition table, which Postgres refuses on an inheritance child or a partition
  (``ALTER TABLE ... INHERIT`` and ``ATTACH PARTITION`` fail while the guard is on).
- **By row**, on a partitioned table (Postgres clones row triggers onto each partition,
  later ones too) and a partition (a statement naming its partitioned table writes its
  rows): ``zz_pglock_guard``, a BEFORE UPDATE OR DELETE row trigger, checks the old row
  before anything changes; ``zz_pglock_guard_stored_insert``, an AFTER INSERT row
  trigger, the row as stored.

In both, ``zz_pglock_guard_stored_update`` is an AFTER UPDATE row trigger that fires only
when the text of a column of the name changed (compared byte for byte: a column's
collation may call two texts equal that make two names), and checks the new name on the
row as stored, so an UPDATE that changes the name needs the old and the new lock; and
``zz_pglock_guard_truncate``, a BEFORE TRUNCATE statement trigger, refuses (a TRUNCATE
changes every tenant's rows at once; cascaded TRUNCATEs fire it too). Their trigger
function ``pglock_guard_<table>()`` is generated for the table, in the table's schema
(dropped with it).

Once per database, in schema ``public``: ``pglock_key(text)`` (equal to
:func:`~pglock_celery.keys.lock_key` for every string), ``pglock_key_from_hex(text)``
(its arithmetic on a digest prefix), and the shared functions of the slow path and of
TRUNCATE. They are replaced only when their text changes, and keep their signatures, so
the triggers of a guard installed by an older release go on working.

A table in a tree of classic inheritance (``CREATE TABLE c () INHERITS (t)``: a parent
or a child that is no partition) is refused: a row stored in a child fires only the
child's row triggers, whatever table the statement names, so no guard on one table
covers the tree. Declarative partitioning does what users want of it. A guarded table
can still gain a child (``ALTER TABLE c INHERIT t``), whose writes then need no lock:
``guarded_parents()`` finds it, and ``doctor`` fails on it.

Every built-in the guard calls is named with its schema (``pg_catalog.``), and its
PL/pgSQL functions run with ``search_path = pg_catalog, pg_temp``: a role whose
search_path holds functions or operators of the same names cannot redirect them.

Who holds a lock: a session whose ``pglock.held`` setting (written by every lock
statement of this library) lists the key, and that gets
``pg_try_advisory_xact_lock(key)``: no other session holds the lock, and none can take
it before this transaction ends. That path never reads ``pg_locks`` (G9). The try is in
the mode the holder holds the key (exclusive): Postgres grants a mode a session already
holds at once, while a try in another mode (shared) is refused behind any session
queued for the key, which would refuse the holder itself while another call waits.
Otherwise (hand-rolled ``pg_advisory_lock`` code) the session's own entries in
``pg_locks`` decide, which costs a scan of the server's lock table per lock name (per
statement, or per row in the row layout). Nothing is remembered from one statement to
the next: a proof is the shared lock itself, which a savepoint rolled back would release.

``SET [LOCAL] pglock.guard = off`` turns the guard off for a session or a transaction.
"""

from __future__ import annotations

import contextlib
import hashlib
import string
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import errors as pg_errors
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict

from .dsn import describe_target, redact
from .exceptions import ConfigurationError, LockTimeout, LockUnavailable
from .keys import lock_key
from .sql import HELD_SETTING

#: The SQLSTATE of a refused write. psycopg raises it as a ``ProgrammingError``
#: (code class ``P``): not an IntegrityError that an ORM might swallow, nor a
#: transaction-rollback error that a retry loop would repeat.
GUARD_SQLSTATE = "PGL01"
#: The session setting that turns the guard off (``SET LOCAL pglock.guard = off``).
GUARD_SETTING = "pglock.guard"
#: The trigger that names a guarded table (with its template): the old rows' check.
ROW_TRIGGER = "zz_pglock_guard"
#: The old rows of a DELETE, in the statement layout (the row layout's ROW_TRIGGER has them).
DELETE_TRIGGER = "zz_pglock_guard_delete"
TRUNCATE_TRIGGER = "zz_pglock_guard_truncate"
STORED_INSERT_TRIGGER = "zz_pglock_guard_stored_insert"
STORED_UPDATE_TRIGGER = "zz_pglock_guard_stored_update"
#: Every trigger a guard puts on a table.
TRIGGERS = (
    ROW_TRIGGER,
    DELETE_TRIGGER,
    STORED_INSERT_TRIGGER,
    STORED_UPDATE_TRIGGER,
    TRUNCATE_TRIGGER,
)
#: The transition tables of the statement layout's triggers.
OLD_ROWS = "pglock_old_rows"
NEW_ROWS = "pglock_new_rows"
#: The application_name of the connection install_guard opens for a DSN.
APPLICATION_NAME = "pglock-celery-guard"
#: Column types whose text in Postgres is what str.format gives for the value psycopg
#: reads from them (str, int, uuid.UUID): text, varchar, smallint, integer, bigint, uuid.
NAME_COLUMN_TYPES = {
    "text": "text",
    "varchar": "character varying",
    "int2": "smallint",
    "int4": "integer",
    "int8": "bigint",
    "uuid": "uuid",
}
#: How long installing or removing waits for its lock on a busy table (when the
#: session has no lock_timeout of its own): a waiting ALTER would queue every writer.
TABLE_LOCK_TIMEOUT = "10s"

# Installers of one database take turns (functions in public, triggers).
_INSTALL_KEY = lock_key("pglock-celery:guard-install")
_FUNCTION_NAME_MAX_BYTES = 63

# The offset arithmetic in numeric, so that nothing overflows bigint: the signed value s
# of the 16 hex digits is u (unsigned) mod 2**64, the key is u - (2**63 - 1) with 2**63
# wrapping to -2**63, that is ((s + 1) mod 2**64) - 2**63. The digest is referenced once,
# so that Postgres inlines pglock_key() into the trigger's expression.
# Functions and operators are named with their schema: an SQL function's body is parsed
# (inlined) under the caller's search_path. bit, bigint and numeric are keywords that
# always mean pg_catalog's types.
_KEY_FROM_HEX = f"""
SELECT ((((('x' OPERATOR(pg_catalog.||) prefix)::bit(64)::bigint::numeric
           OPERATOR(pg_catalog.+) {2**64 + 1}) OPERATOR(pg_catalog.%) {2**64})
         OPERATOR(pg_catalog.-) {2**63}))::bigint
"""
# md5() hashes the text as the server stores it: UTF-8 bytes in a UTF8 (or SQL_ASCII)
# database. Elsewhere convert_to() gives them, at the price of inlining (it is only STABLE).
_KEY = "SELECT public.pglock_key_from_hex(pg_catalog.left(pg_catalog.md5({bytes}), 16))"
_UTF8_BYTES = "name"
_CONVERTED_BYTES = "pg_catalog.convert_to(name, 'UTF8')"

#: The SET clause of the guard's PL/pgSQL functions, as pg_proc.proconfig shows it.
PINNED_SEARCH_PATH = "search_path=pg_catalog, pg_temp"

# Never NULL (an unset setting reads as NULL): the guard is on unless it says off.
_OFF_TEST = (
    f"coalesce(pg_catalog.lower(pg_catalog.current_setting('{GUARD_SETTING}', true))"
    " IN ('off', 'false', 'no', '0'), false)"
)

# The slow path, only when the fast one failed: a hand-rolled holder, or a refusal.
_CHECK = f"""
DECLARE
  db oid := (SELECT oid FROM pg_catalog.pg_database
             WHERE datname = pg_catalog.current_database());
  holder integer;
  holder_name text;
BEGIN
  -- Does this session hold it, by hand-rolled pg_advisory_lock? Then the pin, in the
  -- mode it holds, is granted at once, whoever is queued for the key.
  IF EXISTS (
    SELECT FROM pg_catalog.pg_locks
    WHERE locktype = 'advisory' AND database = db AND objsubid = 1
      AND classid = ((key >> 32) & 4294967295)::oid AND objid = (key & 4294967295)::oid
      AND pid = pg_catalog.pg_backend_pid() AND mode = 'ExclusiveLock' AND granted
  ) AND pg_catalog.pg_try_advisory_xact_lock(key) THEN
    RETURN;
  END IF;
  IF NOT pg_catalog.pg_try_advisory_xact_lock_shared(key) THEN
    SELECT pid INTO holder FROM pg_catalog.pg_locks
    WHERE locktype = 'advisory' AND database = db AND objsubid = 1
      AND classid = ((key >> 32) & 4294967295)::oid AND objid = (key & 4294967295)::oid
      AND mode = 'ExclusiveLock' AND granted
    LIMIT 1;
    SELECT application_name INTO holder_name FROM pg_catalog.pg_stat_activity
    WHERE pid = holder;
  END IF;
  IF holder IS NULL THEN
    RAISE EXCEPTION USING
      ERRCODE = '{GUARD_SQLSTATE}',
      MESSAGE = pg_catalog.format(
        'pglock guard: %s on %I.%I refused: this session does not hold the lock "%s"',
        op, schema_name, table_name, lock_name),
      DETAIL = pg_catalog.format('The lock''s key is %s; no session holds it.', key),
      HINT = pg_catalog.format('Take the lock and write through its connection '
        '(try_lock(%L).connection, or current_lock().connection in a task body); a '
        'migration or an operator can SET LOCAL {GUARD_SETTING} = off.', lock_name);
  END IF;
  -- Held, but by another session: most often a task body that holds the lock and
  -- writes through an ORM (Django's), whose connection is not the lock session.
  RAISE EXCEPTION USING
    ERRCODE = '{GUARD_SQLSTATE}',
    MESSAGE = pg_catalog.format(
      'pglock guard: %s on %I.%I refused: this session does not hold the lock "%s"',
      op, schema_name, table_name, lock_name),
    DETAIL = pg_catalog.format(
      'The lock''s key is %s; the session of backend pid %s holds it (application_name %L).',
      key, holder, holder_name),
    HINT = pg_catalog.format('Another session holds the lock. If this write runs in the '
      'task that holds it, it went through a connection that is not the lock''s: an '
      'ORM''s connection (Django''s django.db.connection, SQLAlchemy''s engine) is not the '
      'lock''s. Write through current_lock().connection or lock.transaction() '
      '(try_lock(%L).connection outside a task); a migration or an operator can '
      'SET LOCAL {GUARD_SETTING} = off.', lock_name);
END
"""

_TRUNCATE = f"""
BEGIN
  IF {_OFF_TEST} THEN
    RETURN NULL;
  END IF;
  RAISE EXCEPTION USING
    ERRCODE = '{GUARD_SQLSTATE}',
    MESSAGE = pg_catalog.format('pglock guard: TRUNCATE of %I.%I refused: it would change '
      'every lock''s rows at once', TG_TABLE_SCHEMA, TG_TABLE_NAME),
    HINT = 'A migration or an operator can SET LOCAL {GUARD_SETTING} = off first.';
END
"""


_PINNED = "SET search_path = pg_catalog, pg_temp"


def shared_functions(server_encoding: str) -> list[tuple[str, str, str]]:
    """(signature, CREATE statement with {} for the body, body) of each shared function."""
    utf8 = server_encoding.upper() in ("UTF8", "SQL_ASCII")
    key = _KEY.format(bytes=_UTF8_BYTES if utf8 else _CONVERTED_BYTES)
    return [
        (
            "public.pglock_key_from_hex(text)",
            "CREATE OR REPLACE FUNCTION public.pglock_key_from_hex(prefix text) RETURNS bigint"
            " LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE AS {}",
            _KEY_FROM_HEX,
        ),
        (
            "public.pglock_key(text)",
            "CREATE OR REPLACE FUNCTION public.pglock_key(name text) RETURNS bigint"
            " LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE AS {}",
            key,
        ),
        (
            "public.pglock_guard_check(text,name,name,text,bigint)",
            "CREATE OR REPLACE FUNCTION public.pglock_guard_check(op text, schema_name name,"
            " table_name name, lock_name text, key bigint) RETURNS void LANGUAGE plpgsql"
            f" {_PINNED} AS {{}}",
            _CHECK,
        ),
        (
            "public.pglock_guard_truncate()",
            "CREATE OR REPLACE FUNCTION public.pglock_guard_truncate() RETURNS trigger"
            f" LANGUAGE plpgsql {_PINNED} AS {{}}",
            _TRUNCATE,
        ),
    ]


_TABLE = """
SELECT c.oid, n.nspname, c.relname, c.relkind
FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
WHERE c.oid = pg_catalog.to_regclass(%s)
"""
# Each column with the type its domains (if any) rest on.
_COLUMNS = """
WITH RECURSIVE base (attname, attgenerated, typ, depth) AS (
  SELECT attname, attgenerated, atttypid, 0
  FROM pg_catalog.pg_attribute WHERE attrelid = %s AND attnum > 0 AND NOT attisdropped
  UNION ALL
  SELECT b.attname, b.attgenerated, t.typbasetype, b.depth + 1
  FROM base b JOIN pg_catalog.pg_type t ON t.oid = b.typ WHERE t.typtype = 'd'
)
SELECT DISTINCT ON (attname) attname, attgenerated, t.typname, pg_catalog.format_type(t.oid, NULL)
FROM base b JOIN pg_catalog.pg_type t ON t.oid = b.typ
ORDER BY attname, depth DESC
"""
# A table's links of classic inheritance, as (parent oid, parent, child): pg_inherits rows
# naming it whose parent is no partitioned table (those are a partition's, which the
# partitioned table's cloned row triggers cover).
_INHERITANCE = """
SELECT i.inhparent, pn.nspname || '.' || p.relname, cn.nspname || '.' || c.relname
FROM pg_catalog.pg_inherits i
JOIN pg_catalog.pg_class p ON p.oid = i.inhparent
JOIN pg_catalog.pg_namespace pn ON pn.oid = p.relnamespace
JOIN pg_catalog.pg_class c ON c.oid = i.inhrelid
JOIN pg_catalog.pg_namespace cn ON cn.oid = c.relnamespace
WHERE %(oid)s IN (i.inhparent, i.inhrelid) AND p.relkind <> 'p'
ORDER BY 2, 3
"""
# Enabled: the old rows' checks fire (by statement, the DELETE one too; tgtype bit 1 is ROW).
_GUARDED = """
SELECT c.oid, n.nspname, c.relname, t.tgargs,
       t.tgenabled IN ('O', 'A')
         AND (t.tgtype & 1 = 1 OR EXISTS (
           SELECT FROM pg_catalog.pg_trigger u WHERE u.tgrelid = t.tgrelid
             AND u.tgname = %(delete)s AND u.tgenabled IN ('O', 'A'))),
       EXISTS (SELECT FROM pg_catalog.pg_trigger u
               WHERE u.tgrelid = t.tgrelid AND u.tgname = %(truncate)s),
       (SELECT pg_catalog.count(*) FROM pg_catalog.pg_trigger u
        WHERE u.tgrelid = t.tgrelid AND u.tgname IN (%(insert)s, %(update)s)
          AND u.tgenabled IN ('O', 'A')) = 2
FROM pg_catalog.pg_trigger t
JOIN pg_catalog.pg_class c ON c.oid = t.tgrelid
JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
WHERE t.tgname = %(row)s AND NOT t.tgisinternal
  AND t.tgparentid = 0  -- a partitioned table, not each partition's clone of its trigger
"""
_TRIGGER = """
SELECT t.tgfoid, t.tgtype, t.tgenabled, t.tgargs, t.tgoldtable, t.tgnewtable
FROM pg_catalog.pg_trigger t WHERE t.tgrelid = %s AND t.tgname = %s
"""
# A table that no statement naming another table writes, and that can be kept so: a
# plain table, not a partition (install_guard refuses an inheritance child).
_BY_STATEMENT = """
SELECT c.relkind = 'r' AND NOT c.relispartition FROM pg_catalog.pg_class c WHERE c.oid = %s
"""
# pg_trigger.tgtype bits: ROW 1, BEFORE 2, INSERT 4, DELETE 8, UPDATE 16, TRUNCATE 32.
_TG_ROW, _TG_BEFORE, _TG_INSERT, _TG_DELETE, _TG_UPDATE, _TG_TRUNCATE = 1, 2, 4, 8, 16, 32
_TRUNCATE_TYPE = _TG_BEFORE | _TG_TRUNCATE


@dataclass(frozen=True)
class _Trigger:
    """One trigger of a layout, as CREATE TRIGGER says it and pg_trigger shows it."""

    name: str
    #: pg_trigger.tgtype.
    kind: int
    #: The transition tables it names (pg_trigger.tgoldtable, tgnewtable).
    old_table: str | None = None
    new_table: str | None = None
    when: sql.Composable | None = None

    def clause(self) -> sql.Composable:
        """What CREATE TRIGGER says between the trigger's name and ON (the timing, events)."""
        timing = "BEFORE" if self.kind & _TG_BEFORE else "AFTER"
        events = [
            event
            for bit, event in (
                (_TG_INSERT, "INSERT"),
                (_TG_UPDATE, "UPDATE"),
                (_TG_DELETE, "DELETE"),
            )
            if self.kind & bit
        ]
        return sql.SQL(f"{timing} {' OR '.join(events)}")

    def tail(self) -> sql.Composable:
        """What CREATE TRIGGER says between ON the table and EXECUTE."""
        tables = [
            sql.SQL("{} TABLE AS {}").format(sql.SQL(side), sql.Identifier(name))
            for side, name in (("OLD", self.old_table), ("NEW", self.new_table))
            if name is not None
        ]
        referencing = sql.SQL(" REFERENCING {}").format(sql.SQL(" ").join(tables))
        return sql.SQL("{} FOR EACH {}{}").format(
            referencing if tables else sql.SQL(""),
            sql.SQL("ROW" if self.kind & _TG_ROW else "STATEMENT"),
            sql.SQL(" WHEN ({})").format(self.when) if self.when is not None else sql.SQL(""),
        )


def layout(parts: list[tuple[str, str | None]], *, by_statement: bool) -> list[_Trigger]:
    """The row-checking triggers of a guard by statement or by row (TRUNCATE's aside).

    In both, STORED_UPDATE_TRIGGER checks the new name of a row whose name columns'
    text changed. By statement it names the old rows' transition table without needing
    them: Postgres refuses a row trigger with a transition table on an inheritance child
    or a partition, so the table can never become one (which would let a statement
    naming its new parent write its rows without firing its statement triggers).
    """
    changed = name_changed(parts)
    if by_statement:
        return [
            _Trigger(ROW_TRIGGER, _TG_UPDATE, old_table=OLD_ROWS),
            _Trigger(DELETE_TRIGGER, _TG_DELETE, old_table=OLD_ROWS),
            _Trigger(STORED_INSERT_TRIGGER, _TG_INSERT, new_table=NEW_ROWS),
            _Trigger(STORED_UPDATE_TRIGGER, _TG_ROW | _TG_UPDATE, old_table=OLD_ROWS, when=changed),
        ]
    return [
        _Trigger(ROW_TRIGGER, _TG_ROW | _TG_BEFORE | _TG_UPDATE | _TG_DELETE),
        _Trigger(STORED_INSERT_TRIGGER, _TG_ROW | _TG_INSERT),
        _Trigger(STORED_UPDATE_TRIGGER, _TG_ROW | _TG_UPDATE, when=changed),
    ]


@dataclass(frozen=True)
class GuardedTable:
    """A table with a guard, as the database shows it."""

    #: ``schema.table``.
    table: str
    #: The lock name template over the table's columns.
    lock_name: str
    #: False when the row trigger is disabled (ALTER TABLE ... DISABLE TRIGGER) or
    #: fires only on replicas: writes are then not guarded.
    enabled: bool
    #: False when the TRUNCATE trigger is missing.
    truncate_guarded: bool
    #: False when a trigger that checks the row as stored (after the table's other
    #: BEFORE triggers) is missing or disabled: a guard from an older release.
    stored_row_guarded: bool


def parse_template(lock_name: str) -> list[tuple[str, str | None]]:
    """Split a lock name template into (literal text, column or None) pairs.

    The syntax of a task's lock_name: ``str.format`` fields that name a column each.
    Only plain names: no positional field, attribute, index, conversion or format spec.
    Raises ConfigurationError saying what is wrong.
    """
    if not isinstance(lock_name, str) or not lock_name:
        raise ConfigurationError(f"lock name template must be a non-empty str, got {lock_name!r}")
    try:
        parsed = list(string.Formatter().parse(lock_name))
    except ValueError as exc:
        raise ConfigurationError(f"lock name template {lock_name!r}: {exc}") from None
    parts: list[tuple[str, str | None]] = []
    for literal, field, spec, conversion in parsed:
        if field is not None:
            if not field.isidentifier():
                raise ConfigurationError(
                    f"lock name template {lock_name!r}: field {{{field}}} must be a plain"
                    " column name (no positional field, attribute or index)"
                )
            if spec or conversion:
                raise ConfigurationError(
                    f"lock name template {lock_name!r}: field {{{field}}} may not have a"
                    " conversion or format spec: the name is built in SQL from the column's text"
                )
        parts.append((literal, field))
    return parts


def template_columns(lock_name: str) -> list[str]:
    """Return the column names a template uses, in order, each once."""
    return list(dict.fromkeys(f for _, f in parse_template(lock_name) if f is not None))


def name_expression(parts: list[tuple[str, str | None]], row: str) -> sql.Composable:
    """The SQL expression of a row's lock name (``row`` is NEW or OLD).

    A column's text is ``value::text`` (text, integers and uuids print as str.format
    prints what psycopg reads from them) and ``None`` for NULL, as str.format of None.
    """
    pieces: list[sql.Composable] = []
    for literal, field in parts:
        if literal:
            pieces.append(sql.Literal(literal))
        if field is not None:
            pieces.append(
                sql.SQL("coalesce({}.{}::text, 'None')").format(sql.SQL(row), sql.Identifier(field))
            )
    return sql.SQL(" || ").join(pieces)


def trigger_function_body(
    parts: list[tuple[str, str | None]], *, by_statement: bool
) -> sql.Composable:
    """The PL/pgSQL body of a table's trigger function, for its layout (see the module).

    Row level, BEFORE UPDATE or DELETE: the old row's lock, before anything changes.
    AFTER INSERT, and AFTER an UPDATE whose name's columns changed: the new row's lock,
    judged on the row as stored, once every BEFORE trigger (ours sorts first or last) has
    run. Statement level (``by_statement``): each distinct name among the statement's new
    rows (INSERT) or old rows (UPDATE, DELETE) once. The guard's off switch is read only
    when the fast path (``pglock.held`` and the shared lock) did not prove the lock.
    """
    by_row = sql.SQL(
        """
  IF TG_WHEN = 'BEFORE' THEN  -- UPDATE, DELETE: the row as it is stored now
    lock_name := {old};
  ELSE  -- AFTER INSERT, UPDATE: the row as it was stored, once every BEFORE trigger ran
    lock_name := {new};
    IF TG_OP = 'UPDATE' THEN  -- fired because the text of a column of the name changed
      old_name := {old};
      IF lock_name = old_name THEN RETURN NULL; END IF;
    END IF;
  END IF;
  key := public.pglock_key(lock_name);
  IF ({unproven}) AND NOT {off} THEN
    PERFORM public.pglock_guard_check(TG_OP, TG_TABLE_SCHEMA, TG_TABLE_NAME, lock_name, key);
  END IF;
  IF TG_WHEN = 'AFTER' THEN RETURN NULL; END IF;
  IF TG_OP = 'DELETE' THEN RETURN OLD; END IF;
  RETURN NEW;"""
    ).format(
        old=name_expression(parts, "OLD"),
        new=name_expression(parts, "NEW"),
        unproven=_unproven(sql.SQL("key")),
        off=sql.SQL(_OFF_TEST),
    )
    statement: sql.Composable = sql.SQL("")
    if by_statement:
        statement = sql.SQL(
            """
  IF TG_LEVEL = 'STATEMENT' THEN
    IF TG_OP = 'INSERT' THEN
      {new_rows}
    ELSE
      {old_rows}
    END IF;
    RETURN NULL;
  END IF;"""
        ).format(
            new_rows=_check_names(parts, NEW_ROWS),
            old_rows=_check_names(parts, OLD_ROWS),
        )
    return sql.SQL(
        """
DECLARE
  lock_name text;
  old_name text;
  key bigint;{refused}
BEGIN{statement}{by_row}
END
"""
    ).format(
        refused=sql.SQL("\n  refused record;" if by_statement else ""),
        statement=statement,
        by_row=by_row,
    )


def _unproven(key: sql.Composable) -> sql.Composable:
    """True unless the fast path proves the lock of ``key``: in pglock.held, and pinned."""
    return sql.SQL(
        "pg_catalog.strpos(coalesce(pg_catalog.current_setting({setting}, true), ''),"
        " ',' || {key} || ',') = 0 OR NOT pg_catalog.pg_try_advisory_xact_lock({key})"
    ).format(setting=sql.Literal(HELD_SETTING), key=key)


def _check_names(parts: list[tuple[str, str | None]], rows: str) -> sql.Composable:
    """Check each distinct lock name of a transition table's rows: PL/pgSQL statements.

    The fast path is one query with no parameter (planned once per session) that finds
    a name whose lock pglock.held and the shared lock do not prove, or none (LIMIT 1:
    ``plpgsql.extra_errors = too_many_rows`` cannot fail it). Only then is the off
    switch read, and each such name goes to the slow path.
    """
    unproven = _unproven_names(parts, rows)
    return sql.SQL(
        """SELECT unproven.n, unproven.k INTO lock_name, key FROM ({unproven}) AS unproven
        LIMIT 1;
      IF FOUND AND NOT {off} THEN
        FOR refused IN {unproven} LOOP
          PERFORM public.pglock_guard_check(
            TG_OP, TG_TABLE_SCHEMA, TG_TABLE_NAME, refused.n, refused.k);
        END LOOP;
      END IF;"""
    ).format(unproven=unproven, off=sql.SQL(_OFF_TEST))


def _unproven_names(parts: list[tuple[str, str | None]], rows: str) -> sql.Composable:
    """The query of a transition table's distinct lock names (n) and keys (k) not proven fast.

    Names are told apart byte for byte (``COLLATE "C"``): a column's own collation may
    hold two texts equal that make two names. The key of each is computed once (OFFSET 0
    keeps the subquery). Its columns are named apart from the function's variables.
    """
    return sql.SQL(
        "SELECT keys.n, keys.k FROM ("
        "SELECT names.n, public.pglock_key(names.n) AS k"
        ' FROM (SELECT DISTINCT ({name}) COLLATE pg_catalog."C" AS n FROM {rows})'
        " AS names OFFSET 0) AS keys"
        " WHERE {unproven}"
    ).format(
        name=name_expression(parts, rows),
        rows=sql.Identifier(rows),
        unproven=_unproven(sql.SQL("keys.k")),
    )


def name_changed(parts: list[tuple[str, str | None]]) -> sql.Composable:
    """The WHEN condition of the stored-row UPDATE trigger: the text of a name column changed.

    The text the name is built from, compared byte for byte: under a nondeterministic
    collation ``'a' = 'A'``, yet they make two names.
    """
    columns = list(dict.fromkeys(field for _, field in parts if field is not None))
    if not columns:
        return sql.SQL("false")
    return sql.SQL(" OR ").join(
        sql.SQL(
            'NEW.{0}::text COLLATE pg_catalog."C" IS DISTINCT FROM'
            ' OLD.{0}::text COLLATE pg_catalog."C"'
        ).format(sql.Identifier(column))
        for column in columns
    )


def trigger_function_name(table: str) -> str:
    """``pglock_guard_<table>``, cut with a hash suffix to fit 63 bytes."""
    name = f"pglock_guard_{table}"
    if len(name.encode()) <= _FUNCTION_NAME_MAX_BYTES:
        return name
    digest = hashlib.md5(table.encode(), usedforsecurity=False).hexdigest()[:8]
    head = name.encode()[: _FUNCTION_NAME_MAX_BYTES - 9].decode(errors="ignore")
    return f"{head}_{digest}"


@contextlib.contextmanager
def _connection(conn_or_dsn: psycopg.Connection | str) -> Iterator[psycopg.Connection]:
    if isinstance(conn_or_dsn, psycopg.Connection):
        yield conn_or_dsn
        return
    if not isinstance(conn_or_dsn, str):
        raise TypeError(
            "conn_or_dsn must be a psycopg Connection or a DSN str,"
            f" not {type(conn_or_dsn).__name__}"
        )
    dsn = conn_or_dsn
    try:
        conninfo_to_dict(dsn)
    except psycopg.ProgrammingError as exc:
        raise ConfigurationError(
            f"not a valid connection string: {redact(str(exc), dsn)}"
        ) from None
    try:
        conn = psycopg.connect(
            dsn, autocommit=True, connect_timeout=10, application_name=APPLICATION_NAME
        )
    except psycopg.Error as exc:
        reason = " ".join(str(exc).split())
        raise LockUnavailable(
            f"cannot connect to {describe_target(dsn)}: {redact(reason, dsn)}"
        ) from exc
    with conn:
        yield conn


@contextlib.contextmanager
def _errors(action: str, conn_or_dsn: psycopg.Connection | str) -> Iterator[None]:
    """Turn psycopg errors into PglockErrors, once, at the boundary."""
    dsn = conn_or_dsn if isinstance(conn_or_dsn, str) else None
    try:
        yield
    except pg_errors.LockNotAvailable as exc:
        raise LockTimeout(
            f"{action}: the table is busy (long transactions hold it), so its lock was not"
            f" granted within the lock_timeout; retry: {_one_line(exc, dsn)}"
        ) from exc
    except psycopg.OperationalError as exc:
        raise LockUnavailable(f"{action}: {_one_line(exc, dsn)}") from exc
    except psycopg.Error as exc:
        raise ConfigurationError(f"{action}: {_one_line(exc, dsn)}") from exc


def _one_line(exc: BaseException, dsn: str | None) -> str:
    return redact(" ".join(str(exc).split()), dsn)


@contextlib.contextmanager
def _transaction(conn: psycopg.Connection) -> Iterator[None]:
    """One transaction (a savepoint inside the caller's), waiting a bounded time for locks.

    Its statements run with ``search_path = pg_catalog, pg_temp`` once the caller's
    table name is resolved (:func:`_pin_search_path`), so that the operators stored in
    a trigger's WHEN clause are pg_catalog's; the caller's own settings come back after.
    """
    with conn.transaction():
        row = conn.execute(
            "SELECT pg_catalog.current_setting('lock_timeout'),"
            " pg_catalog.current_setting('search_path')"
        ).fetchone()
        assert row is not None
        bounded = row[0] == "0"
        if bounded:
            conn.execute(
                "SELECT pg_catalog.set_config('lock_timeout', %s, true)", (TABLE_LOCK_TIMEOUT,)
            )
        conn.execute("SELECT pg_catalog.pg_advisory_xact_lock(%s)", (_INSTALL_KEY,))
        yield
        # The caller's transaction goes on: give it back its own settings.
        if bounded:
            conn.execute("SELECT pg_catalog.set_config('lock_timeout', '0', true)")
        conn.execute("SELECT pg_catalog.set_config('search_path', %s, true)", (row[1],))


def _pin_search_path(conn: psycopg.Connection) -> None:
    conn.execute("SELECT pg_catalog.set_config('search_path', 'pg_catalog, pg_temp', true)")


def _resolve_table(conn: psycopg.Connection, table: str) -> tuple[int, str, str]:
    """Return (oid, schema, name) of ``table`` (SQL syntax, search_path applies)."""
    if not isinstance(table, str) or not table.strip():
        raise ConfigurationError(f"table must be a non-empty str, got {table!r}")
    try:
        with conn.transaction():
            row = conn.execute(_TABLE, (table,)).fetchone()
    except (pg_errors.InvalidName, pg_errors.SyntaxError) as exc:
        raise ConfigurationError(f"{table!r} is not a table name: {_one_line(exc, None)}") from None
    if row is None:
        raise ConfigurationError(f"no table {table!r} in this database (search_path applies)")
    oid, schema, name, kind = row
    if kind not in ("r", "p"):
        raise ConfigurationError(f"{schema}.{name} is not a table (relkind {kind!r})")
    return int(oid), str(schema), str(name)


def _check_columns(
    conn: psycopg.Connection, oid: int, qualified: str, lock_name: str
) -> list[tuple[str, str | None]]:
    parts = parse_template(lock_name)
    columns = {
        name: (generated, typname, shown)
        for name, generated, typname, shown in conn.execute(_COLUMNS, (oid,)).fetchall()
    }
    for field in template_columns(lock_name):
        if field not in columns:
            raise ConfigurationError(
                f"lock name template {lock_name!r} names {{{field}}}, which is not a column of"
                f" {qualified} (its columns: {', '.join(sorted(columns))})"
            )
        generated, typname, shown = columns[field]
        if generated:
            raise ConfigurationError(
                f"{qualified}.{field} is a generated column: a BEFORE trigger sees it before"
                " it is computed, so it cannot be part of a lock name"
            )
        if typname not in NAME_COLUMN_TYPES:
            raise ConfigurationError(
                f"{qualified}.{field} is of type {shown}, whose text in Postgres may differ"
                " from str.format's; a lock name column must be one of: "
                + ", ".join(NAME_COLUMN_TYPES.values())
            )
    return parts


def _function_source(conn: psycopg.Connection, signature: str) -> tuple[str, list[str]] | None:
    """(body, SET clauses) of a function, or None."""
    row = conn.execute(
        "SELECT prosrc, proconfig FROM pg_catalog.pg_proc"
        " WHERE oid = pg_catalog.to_regprocedure(%s)",
        (signature,),
    ).fetchone()
    return (str(row[0]), list(row[1] or [])) if row else None


def _install_shared(conn: psycopg.Connection) -> None:
    """pglock_key() and the guard's shared functions, created or replaced when they differ."""
    if conn.execute("SELECT pg_catalog.to_regnamespace('public')").fetchone() in (None, (None,)):
        raise ConfigurationError(
            "install_guard puts pglock_key() in the schema public, which this database lacks"
        )
    encoding = conn.execute("SELECT pg_catalog.current_setting('server_encoding')").fetchone()
    assert encoding is not None
    for signature, create, body in shared_functions(str(encoding[0])):
        config = [PINNED_SEARCH_PATH] if _PINNED in create else []
        if _function_source(conn, signature) != (body, config):
            conn.execute(sql.SQL(create).format(sql.Literal(body)))


_Found = tuple[int, int, str, bytes, str | None, str | None]


def _trigger(conn: psycopg.Connection, oid: int, name: str) -> _Found | None:
    """(function, tgtype, tgenabled, tgargs, old table, new table) of a trigger, or None."""
    row = conn.execute(_TRIGGER, (oid, name)).fetchone()
    if row is None:
        return None
    return (int(row[0]), int(row[1]), str(row[2]), bytes(row[3]), row[4], row[5])


def _by_statement(conn: psycopg.Connection, oid: int) -> bool:
    row = conn.execute(_BY_STATEMENT, (oid,)).fetchone()
    return bool(row and row[0])


def _first_argument(args: bytes) -> str:
    return bytes(args).split(b"\0")[0].decode()


def _inheritance(conn: psycopg.Connection, oid: int) -> list[tuple[int, str, str]]:
    """(parent oid, parent, child) of each link of classic inheritance naming a table."""
    return [
        (int(parent_oid), str(parent), str(child))
        for parent_oid, parent, child in conn.execute(_INHERITANCE, {"oid": oid}).fetchall()
    ]


def _refuse_inheritance(conn: psycopg.Connection, oid: int, qualified: str) -> None:
    """Raise ConfigurationError if the table has inheritance parents or children."""
    links = _inheritance(conn, oid)
    if links:
        tree = ", ".join(f"{child} inherits from {parent}" for _, parent, child in links)
        _, parent, child = links[0]
        raise ConfigurationError(
            f"{qualified} is in an inheritance tree ({tree}): a row stored in one table of"
            " it fires only that table's row triggers, whatever table a statement names, so"
            " no guard on one table covers the tree. Use declarative partitioning instead"
            " (CREATE TABLE ... PARTITION BY, ATTACH PARTITION): a partitioned table's guard"
            f" covers every partition, later ones too. Or detach (ALTER TABLE {child}"
            f" NO INHERIT {parent})"
        )


def install_guard(conn_or_dsn: psycopg.Connection | str, table: str, lock_name: str) -> None:
    """Guard ``table``: a write to a row needs the lock named by ``lock_name`` over its columns.

    ``lock_name`` is a template with the syntax of a task's lock_name, each field a column
    of the table (text, varchar, smallint, integer, bigint or uuid), e.g.
    ``"training:{tenant_id}"``. Idempotent: installing again with the same template
    changes nothing (and takes no lock on the table); with another, replaces it in place.

    A partitioned table's guard covers its partitions, later ones too. A table with
    inheritance parents or children (``INHERITS``, not partitions) raises
    ConfigurationError: a row stored in a child fires only the child's row triggers.

    Runs in one transaction: a savepoint when ``conn_or_dsn`` is a connection inside a
    transaction (a migration), which the caller then commits. A DSN gets a connection
    of its own. A missing table, a template naming an unknown column or an unsupported
    type raise ConfigurationError before anything changes; a table too busy to lock
    within 10 s raises LockTimeout; connection failures raise LockUnavailable.
    """
    parse_template(lock_name)  # a bad template fails before any connection
    action = f"cannot guard {table!r}"
    with _errors(action, conn_or_dsn), _connection(conn_or_dsn) as conn, _transaction(conn):
        oid, schema, name = _resolve_table(conn, table)
        _pin_search_path(conn)
        qualified = f"{schema}.{name}"
        _refuse_inheritance(conn, oid, qualified)
        parts = _check_columns(conn, oid, qualified, lock_name)
        _install_shared(conn)
        _guard_table(conn, oid, schema, name, parts, lock_name)


def _guard_table(
    conn: psycopg.Connection,
    oid: int,
    schema: str,
    name: str,
    parts: list[tuple[str, str | None]],
    lock_name: str,
) -> None:
    """Create or repair one table's trigger function and triggers; change nothing in place.

    A new function body (another release, template or layout) recreates every trigger:
    the old ones may differ in what pg_trigger does not tell apart (a WHEN clause).
    """
    qualified = f"{schema}.{name}"
    by_statement = _by_statement(conn, oid)
    function = sql.Identifier(schema, trigger_function_name(name))
    body = trigger_function_body(parts, by_statement=by_statement).as_string(conn)
    signature = function.as_string(conn) + "()"
    rewritten = _function_source(conn, signature) != (body, [PINNED_SEARCH_PATH])
    if rewritten:
        conn.execute(
            sql.SQL(
                "CREATE OR REPLACE FUNCTION {}() RETURNS trigger LANGUAGE plpgsql {} AS {}"
            ).format(function, sql.SQL(_PINNED), sql.Literal(body))
        )
        conn.execute(
            sql.SQL("COMMENT ON FUNCTION {}() IS {}").format(
                function, sql.Literal(f"pglock guard of {qualified}: {lock_name}")
            )
        )
    row = conn.execute("SELECT pg_catalog.to_regprocedure(%s)::oid", (signature,)).fetchone()
    assert row is not None
    function_oid = int(row[0])
    target = sql.Identifier(schema, name)
    args = lock_name.encode() + b"\0"
    replaced: set[int] = set()
    wanted = layout(parts, by_statement=by_statement)
    for trigger in wanted:
        old = _trigger(conn, oid, trigger.name)
        expected = (function_oid, trigger.kind, "O", args, trigger.old_table, trigger.new_table)
        if old == expected and not rewritten:
            continue
        conn.execute(
            sql.SQL("CREATE OR REPLACE TRIGGER {} {} ON {}{} EXECUTE FUNCTION {}({})").format(
                sql.Identifier(trigger.name),
                trigger.clause(),
                target,
                trigger.tail(),
                function,
                sql.Literal(lock_name),
            )
        )
        if old is not None and old[2] != "O":
            conn.execute(
                sql.SQL("ALTER TABLE {} ENABLE TRIGGER {}").format(
                    target, sql.Identifier(trigger.name)
                )
            )
        if old is not None and old[0] != function_oid:
            replaced.add(old[0])
    names = {t.name for t in wanted} | {TRUNCATE_TRIGGER}
    for unwanted in [t for t in TRIGGERS if t not in names]:
        old = _trigger(conn, oid, unwanted)
        if old is not None:  # the other layout's, from before the table changed
            conn.execute(sql.SQL("DROP TRIGGER {} ON {}").format(sql.Identifier(unwanted), target))
            if old[0] != function_oid:
                replaced.add(old[0])
    for old_function in replaced:
        _drop_if_ours(conn, old_function)
    truncate = _trigger(conn, oid, TRUNCATE_TRIGGER)
    if truncate is None or truncate[1:3] != (_TRUNCATE_TYPE, "O"):
        conn.execute(
            sql.SQL(
                "CREATE OR REPLACE TRIGGER {} BEFORE TRUNCATE ON {}"
                " FOR EACH STATEMENT EXECUTE FUNCTION public.pglock_guard_truncate()"
            ).format(sql.Identifier(TRUNCATE_TRIGGER), target)
        )
        if truncate is not None and truncate[2] != "O":
            conn.execute(
                sql.SQL("ALTER TABLE {} ENABLE TRIGGER {}").format(
                    target, sql.Identifier(TRUNCATE_TRIGGER)
                )
            )


def _drop_if_ours(conn: psycopg.Connection, function_oid: int) -> None:
    """Drop a trigger function install_guard generated (and nothing else)."""
    row = conn.execute(
        "SELECT oid::pg_catalog.regprocedure::pg_catalog.text FROM pg_catalog.pg_proc"
        " WHERE oid = %s AND proname LIKE 'pglock\\_guard\\_%%'"
        " AND proname <> 'pglock_guard_check' AND proname <> 'pglock_guard_truncate'",
        (function_oid,),
    ).fetchone()
    if row is not None:
        conn.execute(sql.SQL("DROP FUNCTION IF EXISTS {}").format(sql.SQL(row[0])))


def remove_guard(conn_or_dsn: psycopg.Connection | str, table: str) -> None:
    """Remove the guard of ``table``: writes need no lock again. A table without one is fine.

    Leaves ``pglock_key()`` and the shared functions, which other tables may use.
    Raises ConfigurationError for a missing table, and like ``install_guard()``
    otherwise. ``guarded_tables()`` before and after tells what was removed.
    """
    action = f"cannot remove the guard of {table!r}"
    with _errors(action, conn_or_dsn), _connection(conn_or_dsn) as conn, _transaction(conn):
        oid, schema, name = _resolve_table(conn, table)
        _pin_search_path(conn)
        _unguard_table(conn, oid, schema, name)


def _unguard_table(conn: psycopg.Connection, oid: int, schema: str, name: str) -> None:
    target = sql.Identifier(schema, name)
    functions: set[int] = set()
    for trigger in TRIGGERS:
        found = _trigger(conn, oid, trigger)
        if found is not None:
            conn.execute(sql.SQL("DROP TRIGGER {} ON {}").format(sql.Identifier(trigger), target))
            functions.add(found[0])
    for function_oid in functions:
        _drop_if_ours(conn, function_oid)


def guarded_tables(conn: psycopg.Connection) -> list[GuardedTable]:
    """Return every guarded table of the connection's database, by schema and name."""
    tables = [
        GuardedTable(
            table=f"{schema}.{name}",
            lock_name=_first_argument(args),
            enabled=bool(enabled),
            truncate_guarded=bool(truncate),
            stored_row_guarded=bool(stored),
        )
        for _, schema, name, args, enabled, truncate, stored in _guarded_rows(conn)
    ]
    return sorted(tables, key=lambda t: t.table)


def _guarded_rows(conn: psycopg.Connection) -> list[tuple[Any, ...]]:
    return conn.execute(
        _GUARDED,
        {
            "row": ROW_TRIGGER,
            "delete": DELETE_TRIGGER,
            "truncate": TRUNCATE_TRIGGER,
            "insert": STORED_INSERT_TRIGGER,
            "update": STORED_UPDATE_TRIGGER,
        },
    ).fetchall()


def guarded_parents(conn: psycopg.Connection) -> dict[str, list[str]]:
    """Guarded tables with inheritance children, each with its children (``schema.table``).

    install_guard refuses such a table, but a guarded table can gain a child afterwards
    (``CREATE TABLE ... INHERITS``, ``ALTER TABLE ... INHERIT``): a write naming the child
    fires only the child's triggers, so it needs no lock.
    """
    found = {}
    for oid, schema, name, *_ in _guarded_rows(conn):
        children = [child for parent, _, child in _inheritance(conn, oid) if parent == oid]
        if children:
            found[f"{schema}.{name}"] = children
    return found
