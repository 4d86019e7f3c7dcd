"""Checks that a database is set up so that advisory locks on it are safe and fast.

Each check yields a Finding: ``ok``, ``warn`` (worth knowing, not unsafe for
pglock's own sessions) or ``fail`` (locks are unsafe or unusable: fix first).
The doctor may read ``pg_locks`` (a copy of the server's whole lock table); no
per-lock path does.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import math
import os
import re
import socket
import time
import urllib.parse
import uuid
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

import psycopg
from celery import Celery, current_app
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from . import sql
from .config import PglockConfig, get_config, load_config
from .exceptions import ConfigurationError, LockUnavailable
from .guard import ROW_TRIGGER, guarded_parents, guarded_tables
from .keys import key_to_lock_fields, lock_key
from .leader import server_identity
from .operator_session import operator_session
from .patroni import (
    PATRONI_MINIMUMS,
    LeaderFence,
    Timing,
    TimingRejected,
    fenced_check_interval,
    member_started_at,
    shortest_ttl,
    shown,
)
from .session import application_name, open_session

MIN_SERVER_VERSION = 140000
#: Server keepalives slower than this (seconds) leave other sessions' locks
#: stranded for long after a partition.
KEEPALIVE_BOUND_WARN = 300
#: Share of the server's lock table past which the capacity check warns.
CAPACITY_WARN = 0.8


@dataclass(frozen=True)
class Finding:
    check: str
    level: str  # "ok", "warn" or "fail"
    message: str
    fix: str = ""
    #: The shard of pglock_shards the finding is about (None: no shards).
    shard: str | None = None

    def line(self) -> str:
        mark = {"ok": "[ok]  ", "warn": "[warn]", "fail": "[FAIL]"}[self.level]
        text = f"{mark} {self.check}: {self.message}"
        return f"{text}\n         fix: {self.fix}" if self.fix else text

    def as_dict(self) -> dict[str, str]:
        found = asdict(self)
        if found["shard"] is None:
            del found["shard"]  # without shards, the JSON is what it always was
        return found


def _show(conn: psycopg.Connection, name: str) -> str:
    row = conn.execute("SELECT current_setting(%s)", (name,)).fetchone()
    return str(row[0]) if row else ""


def _one(conn: psycopg.Connection, query: str) -> object:
    row = conn.execute(query).fetchone()
    return row[0] if row else None


def _doctor_connect(dsn: str, application_name: str = "pglock-doctor") -> psycopg.Connection:
    """A short session of the doctor's own; it never prepares a statement.

    A transaction pooler hands the next transaction to another backend, where a prepared
    statement of this session is missing, or one of another client's goes by its name.
    """
    return operator_session(dsn, application_name, prepare_threshold=None)


def _server_sees_unix_socket(conn: psycopg.Connection) -> bool:
    """Whether the server's end of this session is a Unix socket (TCP settings do not apply).

    Asked of the server: a pooler or proxy in between may reach it over a socket of
    another kind than this client reached the pooler.
    """
    return _one(conn, "SELECT pg_catalog.inet_client_addr() IS NULL") is True


def _client_on_unix_socket(conn: psycopg.Connection) -> bool:
    return conn.info.host.startswith(("/", "@"))  # a socket directory, or Linux's abstract one


def check_lock_session(dsn: str, pooler: str = "none") -> Iterator[Finding]:
    """Open a real lock session: the settings it asks for must hold."""
    config = PglockConfig(dsn=dsn, pooler=pooler)
    try:
        session = open_session(config, application_name("pglock", "doctor-probe", None))
    except LockUnavailable as exc:
        yield Finding(
            "lock session",
            "fail",
            str(exc),
            "connect lock sessions straight to the primary (no transaction-mode pooler: "
            "it refuses the session settings and splits a session across backends)",
        )
        return
    with session.conn as conn:
        wrong = []
        if _show(conn, "idle_session_timeout") != "0":
            wrong.append("idle_session_timeout")
        if not _server_sees_unix_socket(conn) and _show(conn, "tcp_keepalives_idle") != str(
            config.server_keepalives_idle
        ):
            wrong.append("tcp_keepalives_idle")
        if wrong:
            yield Finding(
                "lock session",
                "fail",
                f"the lock session's own settings did not take: {', '.join(wrong)}",
                "make sure nothing between client and server drops the startup 'options'",
            )
        else:
            yield Finding("lock session", "ok", "opens read-write with its own safety settings")


def check_version(conn: psycopg.Connection) -> Iterator[Finding]:
    number = int(_show(conn, "server_version_num"))
    version = _show(conn, "server_version")
    if number < MIN_SERVER_VERSION:
        yield Finding(
            "version",
            "fail",
            f"PostgreSQL {version}: client_connection_check_interval needs 14 or newer",
            "upgrade to PostgreSQL 14+",
        )
    else:
        yield Finding("version", "ok", f"PostgreSQL {version}")


def check_standby(conn: psycopg.Connection) -> Iterator[Finding]:
    if _one(conn, "SELECT pg_is_in_recovery()"):
        yield Finding(
            "standby",
            "fail",
            "the server is a standby (in recovery): a lock there excludes nobody on the primary",
            "point pglock_dsn at the primary (lock sessions use target_session_attrs=read-write)",
        )
    else:
        yield Finding("standby", "ok", "the server is a primary")


def check_pooler(conn: psycopg.Connection, dsn: str, pooler: str = "none") -> Iterator[Finding]:
    """A session must keep its backend across transactions, even under load.

    ``pooler``: the ``pglock_pooler`` setting; "session" says that a session-mode
    pooler is expected, so a transaction-mode one is named as the setting's mismatch.
    """
    first = _one(conn, "SELECT pg_backend_pid()")
    conn.execute("SELECT set_config('application_name', 'pglock-doctor-probe', false)")
    with operator_session(
        dsn, "pglock-doctor-busy", prepare_threshold=None, autocommit=False
    ) as busy:
        # Hold a server connection in a transaction, so that a transaction
        # pooler would have to hand our next transaction another backend.
        busy.execute("SELECT pg_backend_pid()")
        second = _one(conn, "SELECT pg_backend_pid()")
        name = _show(conn, "application_name")
    if (first != second or name != "pglock-doctor-probe") and pooler == "session":
        yield Finding(
            "pooler",
            "fail",
            "pglock_pooler = 'session', but the pooler between client and server (PgBouncer?)"
            " is in transaction mode: a session does not keep its backend across"
            " transactions, so a lock taken through it belongs to whichever client gets that"
            " backend next (the lock session and the pooler's reset were not tried)",
            "PgBouncer: pool_mode = session for the lock sessions' database (a [databases]"
            " entry of their own with pool_mode=session), or give lock sessions a direct"
            " connection and set pglock_pooler = 'none'",
        )
    elif first != second or name != "pglock-doctor-probe":
        yield Finding(
            "pooler",
            "fail",
            "a session does not keep its backend across transactions: a transaction-mode "
            "pooler (PgBouncer?) sits between client and server",
            "give lock sessions a direct connection or a session-mode pool",
        )
    else:
        yield Finding("pooler", "ok", "sessions keep their backend (no transaction pooler)")


def check_idle_timeouts(conn: psycopg.Connection) -> Iterator[Finding]:
    value = _show(conn, "idle_session_timeout")
    if value != "0":
        yield Finding(
            "idle_session_timeout",
            "fail",
            f"idle_session_timeout = {value}: idle sessions are ended and their locks dropped; "
            "pglock's sessions turn it off for themselves, hand-rolled lock code does not",
            "ALTER ROLE <lock role> SET idle_session_timeout = 0",
        )
    else:
        yield Finding("idle_session_timeout", "ok", "idle sessions are not ended")


def check_keepalives(conn: psycopg.Connection) -> Iterator[Finding]:
    """How long the server takes to notice a client cut off from it.

    Over a Unix socket TCP keepalives do not apply (the server shows them as 0): a peer
    on the same host that dies closes its socket at once. A client that came over TCP
    to a relay (a pooler, a proxy) that reaches the server over a Unix socket is bounded
    by the relay's own keepalives, which the server cannot see.
    """
    if _server_sees_unix_socket(conn):
        if _client_on_unix_socket(conn):
            yield Finding(
                "keepalives",
                "ok",
                "Unix socket: TCP keepalives do not apply; a client on this host that dies"
                " closes its socket, and the server frees its locks at once (no network"
                " between them to partition)",
            )
        else:
            yield Finding(
                "keepalives",
                "warn",
                f"this client reached {conn.info.host} over TCP, but the server sees a Unix"
                " socket: a pooler or proxy on the server's host relays the session, so the"
                " server's TCP keepalives (pglock's lock sessions' too) do not apply; the"
                " relay's own keepalives towards its clients bound a cut-off client",
                "PgBouncer: tcp_keepalive = 1, tcp_keepidle = 5, tcp_keepintvl = 2,"
                " tcp_keepcnt = 5, tcp_user_timeout = 15000 in pgbouncer.ini; or connect"
                " lock sessions straight to the server over TCP",
            )
        return
    idle, interval, count = (
        int(_show(conn, f"tcp_keepalives_{name}")) for name in ("idle", "interval", "count")
    )
    bound = idle + interval * count
    if bound > KEEPALIVE_BOUND_WARN:
        yield Finding(
            "keepalives",
            "warn",
            f"server keepalives notice a cut-off client after about {bound} s (the OS "
            "defaults: 2 h 11 min); pglock's lock sessions set their own bound, other "
            "sessions do not",
            "ALTER SYSTEM SET tcp_keepalives_idle = 5; "
            "ALTER SYSTEM SET tcp_keepalives_interval = 2; "
            "ALTER SYSTEM SET tcp_keepalives_count = 5; "
            "ALTER SYSTEM SET tcp_user_timeout = 15000; "
            "SELECT pg_reload_conf();",
        )
    else:
        yield Finding("keepalives", "ok", f"server keepalives notice a cut-off client in {bound} s")


def _connection_slots(conn: psycopg.Connection) -> tuple[int, int, int]:
    """max_connections, the slots reserved for superusers, and the client sessions now."""
    row = conn.execute(
        "SELECT current_setting('max_connections')::int,"
        " current_setting('superuser_reserved_connections')::int,"
        " (SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend')"
    ).fetchone()
    assert row is not None
    limit, reserved, used = (int(value) for value in row)
    return limit, reserved, used


def check_connections(conn: psycopg.Connection, lock_sessions: int) -> Iterator[Finding]:
    limit, reserved, used = _connection_slots(conn)
    headroom = limit - reserved - used
    figures = f"max_connections {limit}, {reserved} reserved, {used} in use: {headroom} free"
    if lock_sessions and lock_sessions > headroom:
        yield Finding(
            "connections",
            "fail",
            f"{figures}, fewer than the {lock_sessions} lock sessions the fleet may open",
            "raise max_connections, or lower worker concurrency",
        )
    elif headroom < 10:
        yield Finding("connections", "warn", figures, "raise max_connections")
    else:
        yield Finding("connections", "ok", figures)


@dataclass(frozen=True)
class Budget:
    """The fleet a doctor run is asked about: the worker processes that may lock, and the
    locked calls each runs at once (its concurrency).

    ``concurrency_from``: where the concurrency came from when the user did not give
    it (the app's ``worker_concurrency``), shown with the figures; "" when given.
    """

    processes: int
    concurrency: int
    concurrency_from: str = ""

    def sessions(self, config: PglockConfig) -> tuple[int, str]:
        """The most sessions the fleet may open on one shard, and how they are counted.

        Every process may lock names of every shard, and all of its calls at once may
        lock names of one shard: each shard's budget is the whole fleet's. Under
        ``reuse`` a process keeps up to ``pglock_idle_sessions`` idle besides one per
        lock held, under ``connect`` one per lock held, under ``shared`` its
        ``pglock_shared_sessions``. Besides, each process's source of a shard opens
        one probe session per server (probe.py), on first need: when it judges a busy
        lock session from outside.
        """
        if config.strategy == "shared":
            each, parts = config.shared_sessions, f"{config.shared_sessions} shared"
        elif config.strategy == "connect":
            each, parts = self.concurrency, f"{self.concurrency} held"
        else:
            each = config.idle_sessions + self.concurrency
            parts = f"{config.idle_sessions} idle + {self.concurrency} held"
        total = self.processes * (each + 1)
        processes = f"{self.processes} process{'es' if self.processes != 1 else ''}"
        return total, f"{processes} x ({parts}) + {self.processes} probe = {total} sessions"


def check_budget(
    conn: psycopg.Connection, budget: Budget, config: PglockConfig
) -> Iterator[Finding]:
    """The most sessions the fleet (``budget``) may open here against the free connections.

    Free is what check_connections counts: max_connections less the superuser slots and
    the client sessions now. A fleet running now has its own sessions among those in use;
    the fix says so. More shards do not help: each shard's budget is the whole fleet's.
    """
    limit, reserved, used = _connection_slots(conn)
    total, formula = budget.sessions(config)
    free = limit - reserved - used
    given = f", concurrency from {budget.concurrency_from}" if budget.concurrency_from else ""
    figures = (
        f"{formula} ({config.strategy}{given}); {free} free (max_connections {limit} - "
        f"{reserved} reserved - {used} in use)"
    )
    if total <= free:
        yield Finding("budget", "ok", f"{figures}: fits")
        return
    if config.strategy == "shared":
        fewer = f"lower pglock_shared_sessions (now {config.shared_sessions})"
    elif config.strategy == "connect":
        fewer = "lower the concurrency, or use pglock_strategy = 'shared'"
    else:
        fewer = (
            f"lower pglock_idle_sessions (now {config.idle_sessions}) or the concurrency, "
            "or use pglock_strategy = 'shared'"
        )
    yield Finding(
        "budget",
        "fail",
        f"{figures}: {total - free} more than free",
        f"raise max_connections to at least {total + reserved + used}, run fewer worker "
        f"processes, or {fewer}; if the fleet runs now, its own sessions are among the "
        f"{used} in use: count only the processes to add",
    )


def check_shard_maps(conn: psycopg.Connection, config: PglockConfig) -> Iterator[Finding]:
    """Whether this database's record of the shard maps (rollout.py) lets this
    configuration's workers lock."""
    identity = config.map_identity
    row = conn.execute(sql.SHARD_RECORD_EXISTS).fetchone()
    if identity is None or row is None or not row[0]:
        yield Finding(
            "shard maps",
            "ok",
            "no record of the shard maps: a worker of any map may lock here "
            "(`pglock-celery shards init` fences a change of the shards)",
        )
        return
    accepted = [r[0] for r in conn.execute(sql.ACCEPTED_MAPS).fetchall()]
    shown = ", ".join(accepted) or "none"
    if identity.name in accepted:
        yield Finding(
            "shard maps", "ok", f"this configuration's map {identity.name} is accepted (of {shown})"
        )
    else:
        yield Finding(
            "shard maps",
            "fail",
            f"this configuration's map {identity.name} is not accepted here (only {shown}): "
            "its workers' locks fail closed",
            "finish the change of the shards under way, or run the workers with a map "
            "accepted (pglock-celery shards status)",
        )


# Entries of the shared lock table in use (fast-path locks live in each backend, not
# there; every advisory lock takes an entry), the advisory ones, and those held by
# pglock's sessions (application_name "<prefix>|..." or "<prefix>-<state>|..."); not
# the locks of this query itself.
_LOCK_TABLE = """
SELECT current_setting('max_locks_per_transaction')::int,
       current_setting('max_connections')::int,
       current_setting('max_prepared_transactions')::int,
       count(*) FILTER (WHERE NOT l.fastpath),
       count(*) FILTER (WHERE l.locktype = 'advisory'),
       count(*) FILTER (WHERE l.locktype = 'advisory' AND a.application_name ~ %s)
FROM pg_locks l LEFT JOIN pg_stat_activity a ON a.pid = l.pid
WHERE l.pid IS DISTINCT FROM pg_backend_pid()
"""


_PAST = (
    "past the lock table's size; Postgres may find spare shared memory for some more, "
    "then new locks (advisory or any other, in every database) fail with 'out of shared memory'"
)


def check_capacity(conn: psycopg.Connection, locks: int, prefix: str) -> Iterator[Finding]:
    """How many advisory locks the server can hold, how many are held, and the fleet's need.

    ``locks`` is the most locks the fleet holds at once (0: unknown). Locks held
    now by pglock sessions (``prefix``) are counted in it, not on top of it.
    """
    pattern = f"^{re.escape(prefix)}(-[^|]*)?[|]"
    row = conn.execute(_LOCK_TABLE, (pattern,)).fetchone()
    assert row is not None
    per, connections, prepared, in_use, advisory, ours = (int(value) for value in row)
    capacity = per * (connections + prepared)
    need = in_use - ours + locks
    figures = (
        f"room for {capacity:,} locks (max_locks_per_transaction {per} x (max_connections "
        f"{connections} + max_prepared_transactions {prepared})), {in_use:,} in use "
        f"({advisory:,} advisory, {ours:,} of them by pglock sessions)"
    )
    if locks:
        figures += f"; with the fleet's {locks:,} that makes {need:,}"
    wanted = math.ceil(max(need, in_use) / CAPACITY_WARN / (connections + prepared) / 64) * 64
    fix = (
        f"ALTER SYSTEM SET max_locks_per_transaction = {max(wanted, 64)} and restart Postgres "
        "(the lock table is sized at start), or fewer locks held at once"
    )
    # Locks held now may be a passing peak: only the fleet's own stated need fails.
    if locks and need > capacity:
        yield Finding("capacity", "fail", f"{figures}: {_PAST}", fix)
    elif max(need, in_use) > capacity:
        yield Finding("capacity", "warn", f"{figures}: {_PAST}", fix)
    elif max(need, in_use) > CAPACITY_WARN * capacity:
        yield Finding(
            "capacity", "warn", f"{figures}: over {CAPACITY_WARN:.0%} of the lock table", fix
        )
    else:
        yield Finding("capacity", "ok", figures)


def check_privileges(conn: psycopg.Connection) -> Iterator[Finding]:
    can_lock = _one(
        conn,
        "SELECT pg_catalog.has_function_privilege("
        "'pg_catalog.pg_try_advisory_lock(bigint)', 'EXECUTE')",
    )
    if not can_lock:
        yield Finding(
            "privileges",
            "fail",
            "this role may not call pg_try_advisory_lock(bigint)",
            "GRANT EXECUTE ON FUNCTION pg_try_advisory_lock(bigint) TO <lock role>",
        )
        return
    sees_all = _one(
        conn,
        "SELECT rolsuper OR pg_has_role(current_user, 'pg_read_all_stats', 'MEMBER')"
        " FROM pg_roles WHERE rolname = current_user",
    )
    if not sees_all:
        yield Finding(
            "privileges",
            "warn",
            "this role cannot see other roles' client addresses in pg_stat_activity",
            "GRANT pg_read_all_stats TO <inspecting role>",
        )
    else:
        yield Finding("privileges", "ok", "may take advisory locks and see every holder")


def check_guards(conn: psycopg.Connection) -> Iterator[Finding]:
    """One finding per guarded table: its lock name, and whether the whole guard is on."""
    tables = guarded_tables(conn)
    parents = guarded_parents(conn)
    if not tables:
        yield Finding("guarded tables", "ok", "none (pglock-celery guard install TABLE --lock ...)")
    for table in tables:
        install = f"pglock-celery guard install {table.table} --lock '{table.lock_name}'"
        if not table.enabled:
            yield Finding(
                "guarded table",
                "fail",
                f"{table.table} (lock {table.lock_name}): its trigger is disabled, so writes"
                " without the lock go through",
                f"ALTER TABLE {table.table} ENABLE TRIGGER {ROW_TRIGGER}, or {install}",
            )
        elif table.table in parents:
            children = parents[table.table]
            yield Finding(
                "guarded table",
                "fail",
                f"{table.table} (lock {table.lock_name}) has inheritance children"
                f" ({', '.join(children)}): a write naming a child fires only the child's"
                f" triggers, so the guard of {table.table} does not cover the child's rows",
                "guard a partitioned table instead (CREATE TABLE ... PARTITION BY, ATTACH"
                " PARTITION), whose guard covers every partition; or "
                + "; ".join(f"ALTER TABLE {child} NO INHERIT {table.table}" for child in children),
            )
        elif not table.stored_row_guarded:
            yield Finding(
                "guarded table",
                "fail",
                f"{table.table} (lock {table.lock_name}): the row as stored is not checked"
                " (a guard from an older release, or its AFTER triggers were dropped or"
                " disabled): a BEFORE trigger that fires after the guard can move a row to"
                " a lock its writer does not hold",
                install,
            )
        elif not table.truncate_guarded:
            yield Finding(
                "guarded table",
                "warn",
                f"{table.table} (lock {table.lock_name}): TRUNCATE is not guarded",
                install,
            )
        else:
            yield Finding("guarded table", "ok", f"{table.table}: lock {table.lock_name}")


#: Built-ins that pglock's statements and the guard call, by name.
SHADOWABLE = (
    "pg_advisory_lock",
    "pg_advisory_unlock",
    "pg_advisory_unlock_all",
    "pg_advisory_xact_lock",
    "pg_try_advisory_lock",
    "pg_try_advisory_xact_lock_shared",
    "pg_backend_pid",
    "pg_is_in_recovery",
    "current_setting",
    "set_config",
    "current_database",
    "strpos",
    "lower",
    "left",
    "md5",
    "convert_to",
    "format",
)
# Functions and operators in a schema that the role's search_path puts before
# pg_catalog, named like a built-in: an unqualified call may resolve to them.
_SHADOWS = """
WITH path AS (
  SELECT s.name, s.position FROM pg_catalog.unnest(pg_catalog.current_schemas(true))
  WITH ORDINALITY AS s (name, position)
), early AS (
  SELECT n.oid, n.nspname FROM pg_catalog.pg_namespace n JOIN path ON path.name = n.nspname
  WHERE path.position < (SELECT position FROM path WHERE name = 'pg_catalog')
)
SELECT early.nspname || '.' || p.proname || '('
       || pg_catalog.pg_get_function_identity_arguments(p.oid) || ')'
FROM pg_catalog.pg_proc p JOIN early ON early.oid = p.pronamespace
WHERE p.proname = ANY (%s)
UNION ALL
SELECT early.nspname || '.' || o.oprname || ' (operator)'
FROM pg_catalog.pg_operator o JOIN early ON early.oid = o.oprnamespace
ORDER BY 1
"""


def check_search_path(conn: psycopg.Connection) -> Iterator[Finding]:
    """No function or operator on the role's search_path may stand in for a built-in.

    ``pg_catalog`` is searched first unless the search_path names it later: a schema
    before it that holds e.g. ``pg_try_advisory_lock(bigint)`` or an ``=`` operator
    redirects any SQL that calls them by their bare names (hand-rolled lock code too).
    """
    shadows = [str(name) for (name,) in conn.execute(_SHADOWS, (list(SHADOWABLE),)).fetchall()]
    path = _show(conn, "search_path")
    if shadows:
        yield Finding(
            "search_path",
            "fail",
            f"search_path = {path} puts schemas before pg_catalog that hold "
            f"{', '.join(shadows)}: SQL calling the built-ins by their bare names runs these",
            "ALTER ROLE <lock role> SET search_path = pg_catalog, public (pg_catalog first), "
            "or drop the impostors",
        )
    else:
        yield Finding("search_path", "ok", "nothing on the search_path shadows a built-in")


#: How long the reset probe tries to get its server connection back from the pooler.
RESET_PROBE_SECONDS = 10.0
#: Client connections the reset probe holds at once while it looks for its server
#: connection (each holds a server connection that is not the one it wants).
RESET_PROBE_HOLD = 3
_PROBE_SETTING = "pglock.doctor_probe"
_PROBE_STATE = """
SELECT pg_catalog.pg_backend_pid(), pg_catalog.current_setting(%s, true),
       EXISTS (SELECT FROM pg_catalog.pg_locks
               WHERE locktype = 'advisory' AND pid = pg_catalog.pg_backend_pid()
                 AND classid = %s::oid AND objid = %s::oid AND objsubid = 1)
"""


def check_pooler_reset(dsn: str, pooler: str) -> Iterator[Finding]:
    """Behind a session pooler, find out by trying whether a server connection comes back reset.

    A holder that dies leaves its client connection, not the server's: the pooler hands
    the server connection to its next client with the dead holder's locks still on it,
    unless its reset query (PgBouncer's ``server_reset_query = DISCARD ALL``) frees them.
    The probe takes an advisory lock of its own and sets a session setting on one client
    connection, disconnects, and reconnects until the pooler hands out the same server
    backend (``pg_backend_pid()``), then looks whether either survived.
    """
    if pooler != "session":
        return
    token = uuid.uuid4().hex
    key = lock_key(f"pglock-doctor-reset-probe:{token}")
    classid, objid = key_to_lock_fields(key)
    with _probe_connect(dsn) as first:
        row = first.execute(
            "SELECT pg_catalog.pg_backend_pid(), pg_catalog.pg_advisory_lock(%s),"
            " pg_catalog.set_config(%s, %s, false)",
            (key, _PROBE_SETTING, token),
        ).fetchone()
        assert row is not None
        backend = int(row[0])
    found = _same_backend_again(dsn, backend, (_PROBE_SETTING, classid, objid))
    if found is None:
        yield Finding(
            "pooler reset",
            "warn",
            f"could not get the probe's server connection (backend {backend}) back from the"
            f" pooler within {RESET_PROBE_SECONDS:g} s, so whether the pooler resets a server"
            " connection before handing it to another client is unknown (a busy pool?)",
            "make sure the pooler resets server connections: PgBouncer server_reset_query ="
            " DISCARD ALL (its default)",
        )
        return
    setting_kept, lock_kept = found[0] == token, bool(found[1])
    if lock_kept or setting_kept:
        kept = "its advisory lock" if lock_kept else "its session setting"
        yield Finding(
            "pooler reset",
            "fail",
            f"the pooler handed a server connection to the next client with {kept} still on"
            " it: a holder that dies behind this pooler keeps its locks until the pooler"
            " closes that server connection, and the next client to get it holds them",
            "PgBouncer: server_reset_query = DISCARD ALL (its default; an empty value turns"
            " the reset off) in pgbouncer.ini, then RELOAD; server_reset_query_always does"
            " not matter in session pools",
        )
    else:
        yield Finding(
            "pooler reset",
            "ok",
            "the pooler resets a server connection (advisory locks, settings) before handing"
            " it to the next client",
        )


def _probe_connect(dsn: str) -> psycopg.Connection:
    return _doctor_connect(dsn, "pglock-doctor-probe")


def _same_backend_again(
    dsn: str, backend: int, probe: tuple[str, int, int]
) -> tuple[object, object] | None:
    """Connect until the pooler hands out ``backend``: (its probe setting, lock kept?).

    Connections given other server backends are held a while, so that the pooler cannot
    hand those back instead (PgBouncer reuses the last one released first); the probe's
    lock is released when found.
    """
    deadline = time.monotonic() + RESET_PROBE_SECONDS
    while time.monotonic() < deadline:
        with contextlib.ExitStack() as held:
            for _ in range(RESET_PROBE_HOLD):
                conn = held.enter_context(_probe_connect(dsn))
                row = conn.execute(_PROBE_STATE, probe).fetchone()
                assert row is not None
                if int(row[0]) == backend:
                    conn.execute("SELECT pg_catalog.pg_advisory_unlock_all()")
                    return row[1], row[2]
    return None


def check_replication(conn: psycopg.Connection) -> Iterator[Finding]:
    """A server with replicas must commit synchronously, or a failover loses fenced writes.

    A failover promotes a replica; a write acknowledged on the old primary but not yet
    on the replica is gone, although it was made under its lock (G12).
    """
    row = conn.execute(
        "SELECT (SELECT pg_catalog.count(*) FROM pg_catalog.pg_stat_replication),"
        " (SELECT pg_catalog.count(*) FROM pg_catalog.pg_stat_replication"
        "  WHERE sync_state IN ('sync', 'quorum')),"
        " (SELECT pg_catalog.count(*) FROM pg_catalog.pg_stat_replication"
        "  WHERE sync_state IS NOT NULL),"
        " pg_catalog.current_setting('synchronous_standby_names'),"
        " pg_catalog.current_setting('synchronous_commit')"
    ).fetchone()
    assert row is not None
    replicas, synchronous, visible, names, commit = row
    fix = (
        "Patroni: synchronous_mode: true and synchronous_mode_strict: true in the cluster's"
        " dynamic configuration (patronictl edit-config); without Patroni: ALTER SYSTEM SET"
        " synchronous_standby_names = 'ANY 1 (*)'; SELECT pg_reload_conf();"
    )
    if not replicas:
        yield Finding("replication", "ok", "no streaming replica: nothing to fail over to")
    elif not str(names).strip():
        yield Finding(
            "replication",
            "fail",
            f"{replicas} streaming replica(s), but commits are asynchronous"
            " (synchronous_standby_names is empty): a failover to a replica loses writes"
            " that were acknowledged under their lock, and a deposed primary acknowledges"
            " writes nobody else will see",
            fix,
        )
    elif commit in ("off", "local"):
        yield Finding(
            "replication",
            "fail",
            f"synchronous_commit = {commit} for this role (the lock role): its commits do"
            f" not wait for the synchronous standby ({names}), so a failover can lose them",
            "ALTER ROLE <lock role> SET synchronous_commit = on (and no SET on the way: per"
            " database, in the DSN's options or the application); " + fix,
        )
    elif visible and not synchronous:
        yield Finding(
            "replication",
            "warn",
            f"synchronous_standby_names = {names}, but none of the {replicas} replica(s) is"
            " synchronous now: commits wait until one is",
            "check the standbys' names (application_name in primary_conninfo) against"
            " synchronous_standby_names",
        )
    else:
        yield Finding(
            "replication",
            "ok",
            f"{replicas} streaming replica(s); commits wait for a synchronous standby"
            f" ({names}, synchronous_commit = {commit})",
        )


def check_fence_urls(fence: LeaderFence) -> Iterator[Finding]:
    """Every member URL of pglock_patroni_url must answer ``GET /patroni`` within the
    fence's timeout: a member that does not can confirm no lock on its server."""
    silent = []
    refused = []  # TLS failed: the member answers, its certificate or ours is the problem
    for url in fence.urls:
        answer = fence.status(url, "/patroni")
        if answer.tls:
            refused.append(f"{shown(url)} ({answer.error})")
        elif answer.status != 200:
            silent.append(
                f"{shown(url)} ({answer.error if answer.status == 0 else f'HTTP {answer.status}'})"
            )
    if refused:
        yield Finding(
            "patroni urls",
            "fail",
            f"TLS with {', '.join(refused)} failed, a certificate problem (the member is up):"
            " a lock on such a member's server is refused (cannot tell)",
            "pglock_patroni_cafile: the CA that signs the members' REST API certificates;"
            " pglock_patroni_certfile and pglock_patroni_keyfile: a client certificate that"
            " CA signs, where restapi.verify_client asks for one (SSL_CERT_FILE is not needed)",
        )
    if silent:
        yield Finding(
            "patroni urls",
            "fail",
            f"no answer to GET /patroni within {fence.timeout:g} s from {', '.join(silent)}:"
            " a lock on such a member's server is refused (cannot tell)",
            "start that member's Patroni, or correct its URL in pglock_patroni_url",
        )
    elif not refused:
        yield Finding(
            "patroni urls",
            "ok",
            f"all {len(fence.urls)} answer GET /patroni within {fence.timeout:g} s",
        )


def read_cluster(fence: LeaderFence) -> list[dict[str, Any]] | None:
    """The members Patroni reports (``GET /cluster`` of the first URL that answers)."""
    for url in fence.urls:
        answer = fence.status(url, "/cluster")
        members = answer.body.get("members") if isinstance(answer.body, dict) else None
        if answer.status == 200 and isinstance(members, list):
            return [m for m in members if isinstance(m, dict)]
    return None


def _api_base(member: dict[str, Any]) -> str | None:
    """A member's REST API URL as the setting lists it (scheme, host and port)."""
    raw = member.get("api_url")
    if not isinstance(raw, str):
        return None
    parts = urllib.parse.urlsplit(raw)
    return f"{parts.scheme}://{shown(raw)}" if parts.hostname and parts.port else None


def _status_name(body: Any) -> str | None:
    patroni = body.get("patroni") if isinstance(body, dict) else None
    name = patroni.get("name") if isinstance(patroni, dict) else None
    return name if isinstance(name, str) else None


def _addresses(host: str, port: int) -> set[tuple[str, int]]:
    """Where ``host`` leads (its addresses; the name itself when it does not resolve)."""
    try:
        found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return {(host, port)}
    return {(str(info[4][0]), port) for info in found}


def _members_answering(fence: LeaderFence) -> tuple[dict[str, tuple[str, Any]], list[str]]:
    """Each member that one of the setting's URLs reaches, by the name it gives in its
    own ``GET /patroni`` answer, with that URL and answer; and the URLs that gave none."""
    answering: dict[str, tuple[str, Any]] = {}
    silent: list[str] = []
    for url in fence.urls:
        answer = fence.status(url, "/patroni")
        name = _status_name(answer.body) if answer.status == 200 else None
        if name is None:
            silent.append(url)
        else:
            answering.setdefault(name, (url, answer.body))
    return answering, silent


def _reached_by(base: str, urls: list[str]) -> str | None:
    """The URL of ``urls`` that leads where ``base`` does (same addresses and port)."""
    parts = urllib.parse.urlsplit(base)
    if parts.hostname is None or parts.port is None:
        return None
    where = _addresses(parts.hostname, parts.port)
    for url in urls:
        other = urllib.parse.urlsplit(url)
        port = other.port or (443 if other.scheme == "https" else 80)
        if other.hostname and where & _addresses(other.hostname, port):
            return url
    return None


def check_fence_members(fence: LeaderFence, members: list[dict[str, Any]]) -> Iterator[Finding]:
    """pglock_patroni_url must list every member of the cluster (A5 in patroni.py).

    A member left out can be promoted, and a lock on its server is never confirmed;
    a URL listing only a replica leaves the leader out. A member is listed when one of
    the URLs reaches it: its ``GET /patroni`` answer gives the member's name, however
    the URL and Patroni's ``api_url`` spell its host; a URL that gives no answer counts
    for the member whose ``api_url`` leads to the same address and port.
    """
    answering, silent = _members_answering(fence)
    listed: dict[str, str] = {}  # member name -> the setting's URL for it
    missing: list[tuple[dict[str, Any], str]] = []
    for member in members:
        base = _api_base(member)
        name = member.get("name")
        if isinstance(name, str) and name in answering:
            listed[name] = answering[name][0]
        elif base is not None:
            url = _reached_by(base, silent)
            if url is None:
                missing.append((member, base))
            elif isinstance(name, str):
                listed[name] = url
    if missing:
        names = ", ".join(f"{m.get('name')} ({shown(base)})" for m, base in missing)
        # Each member once: the setting's URLs as written, then the ones left out.
        urls = ",".join(dict.fromkeys([*fence.urls, *(base for _, base in missing)]))
        yield Finding(
            "patroni members",
            "fail",
            f"pglock_patroni_url leaves out {len(missing)} of the cluster's {len(members)}"
            f" members: {names}; a lock on a left-out member's server is never confirmed",
            f'app.conf.pglock_patroni_url = "{urls}"',
        )
    else:
        yield Finding(
            "patroni members",
            "ok",
            f"pglock_patroni_url lists every one of the cluster's {len(members)} members",
        )


def _dsn_hosts(dsn: str) -> list[tuple[str, int]]:
    """The (host, port) pairs a DSN lists, as libpq pairs them (one port serves all)."""
    params = conninfo_to_dict(dsn)
    hosts = str(params.get("host") or params.get("hostaddr") or "localhost").split(",")
    ports = str(params.get("port") or "5432").split(",")
    ports = ports * len(hosts) if len(ports) == 1 else ports
    return [(host, int(port or 5432)) for host, port in zip(hosts, ports, strict=False)]


def _host_identity(dsn: str, host: str, port: int) -> datetime.datetime | None:
    """The postmaster start time of the server at ``host``:``port`` of ``dsn`` (what the
    fence knows a server by: leader.server_identity), None when it cannot be reached."""
    params = conninfo_to_dict(dsn)
    params.pop("hostaddr", None)
    params.update(host=host, port=str(port), target_session_attrs="any")
    try:
        with _doctor_connect(make_conninfo("", **params)) as conn:
            return server_identity(conn).started_at
    except psycopg.Error:
        return None


def check_fence_leader(
    dsn: str, members: list[dict[str, Any]], fence: LeaderFence
) -> Iterator[Finding]:
    """The leader's Postgres must be one of the DSN's hosts: the same server (postmaster
    start time, as the fence knows it) whichever way the DSN and Patroni spell its host."""
    leaders = [m for m in members if m.get("role") in ("leader", "standby_leader")]
    if len(leaders) != 1:
        yield Finding(
            "patroni leader",
            "fail",
            f"GET /cluster reports {len(leaders)} leaders: no lock can be confirmed now",
            "patronictl list: wait for the cluster to elect a leader, or see why it cannot",
        )
        return
    leader = leaders[0]
    where = (str(leader.get("host")), int(leader.get("port") or 5432))
    hosts = _dsn_hosts(dsn)
    answering, _ = _members_answering(fence)
    body = answering.get(str(leader.get("name")), (None, None))[1]
    base = _api_base(leader)
    if body is None and base is not None:
        body = fence.status(base, "/patroni").body
    started = member_started_at(body)
    if started is not None:
        found = any(_host_identity(dsn, host, port) == started for host, port in hosts)
    else:  # its start time unknown: where the DSN's hosts and Patroni's lead, by address
        found = any(_addresses(*where) & _addresses(host, port) for host, port in hosts)
    if not found:
        spelled = ((str(m.get("host")), int(m.get("port") or 5432)) for m in members)
        every = list(dict.fromkeys(spelled))
        yield Finding(
            "patroni leader",
            "fail",
            f"the leader {leader.get('name')} runs on {where[0]}:{where[1]}, not one of"
            f" pglock_dsn's hosts ({', '.join(f'{h}:{p}' for h, p in hosts)}): lock"
            " sessions cannot reach the primary",
            f"in pglock_dsn: host={','.join(h for h, _ in every)}"
            f" port={','.join(str(p) for _, p in every)} target_session_attrs=read-write",
        )
    else:
        yield Finding(
            "patroni leader",
            "ok",
            f"the leader {leader.get('name')} ({where[0]}:{where[1]}) is one of pglock_dsn's hosts",
        )


def _rejected_timing(fence: LeaderFence) -> Finding | None:
    """The finding for a dynamic configuration Patroni cannot read, if a member gives one."""
    for url in fence.urls:
        answer = fence.status(url, "/config")
        if answer.status != 200:
            continue
        try:
            Timing.from_config(answer.body)
        except TimingRejected as exc:
            raw = answer.body.get(exc.key)
            try:
                seconds = float(raw) if not isinstance(raw, bool) else math.nan
            except (TypeError, ValueError):
                seconds = math.nan
            least = PATRONI_MINIMUMS[exc.key]
            whole = max(round(seconds), least) if math.isfinite(seconds) else least
            return Finding(
                "patroni window",
                "fail",
                f"{exc} ({shown(url)}): every lock is refused until it is fixed",
                f"patronictl edit-config -s {exc.key}={whole}",
            )
        except ValueError:
            continue
    return None


def check_fence_window(fence: LeaderFence, check_interval: float) -> Iterator[Finding]:
    """Patroni's ttl, loop_wait and retry_timeout must leave room to check a fenced lock,
    and be values Patroni runs with as they are (Timing.from_config)."""
    timing = fence.read_timing()
    if timing is None:
        yield _rejected_timing(fence) or Finding(
            "patroni window",
            "fail",
            "no member gave Patroni's dynamic configuration (GET /config): every lock is"
            " refused until one does",
            "patronictl show-config: make the members' REST APIs answer",
        )
        return
    figures = (
        f"at ttl {timing.ttl:g}/loop_wait {timing.loop_wait:g}/retry_timeout"
        f" {timing.retry_timeout:g}"
    )
    if timing.changes:
        figures += (
            f" (Patroni changes {', '.join(timing.changes)}; the window is the narrower of"
            " both readings)"
        )
    window = max(timing.window(fence.margin), 0.0)
    fits = fenced_check_interval(
        timing, wanted=check_interval, timeout=fence.timeout, margin=fence.margin
    )
    if fits is None:
        least = shortest_ttl(timing, timeout=fence.timeout, margin=fence.margin)
        yield Finding(
            "patroni window",
            "fail",
            f"window {window:g} s {figures}: too short to keep any lock confirmed between two"
            f" checks (workers refuse to start); the least ttl that fits is {least:g}",
            f"patronictl edit-config -s ttl={least:g}",
        )
    elif timing.changes:
        yield Finding(
            "patroni window",
            "warn",
            f"window {window:g} s {figures}: locks checked every {fits:.2g} s",
            "patronictl edit-config "
            + " ".join(f"-s {key}={value:g}" for key, value in timing.runs_with),
        )
    else:
        yield Finding(
            "patroni window",
            "ok",
            f"window {window:g} s {figures}: locks checked every {fits:.2g} s",
        )


def fence_checks(
    dsn: str, urls: tuple[str, ...], check_interval: float, config: PglockConfig | None = None
) -> Iterator[Finding]:
    """The leader fence's checks (pglock_patroni_url set); replication is checked apart.

    ``config``'s TLS files (pglock_patroni_cafile, ...) reach the members as the fence's do.
    """
    fence = LeaderFence.from_setting(urls, config)
    yield from check_fence_urls(fence)
    members = read_cluster(fence)
    if members is None:
        yield Finding(
            "patroni members",
            "fail",
            "no member answered GET /cluster: the cluster's members are unknown",
            "start the members' Patroni, or correct pglock_patroni_url",
        )
    else:
        yield from check_fence_members(fence, members)
        yield from check_fence_leader(dsn, members, fence)
    yield from check_fence_window(fence, check_interval)


def read_settings(app: Celery | None = None) -> tuple[PglockConfig, ConfigurationError | None]:
    """The pglock settings of ``app`` (default: the current app), and what is invalid in them.

    With an invalid value the valid ones still count and the invalid one takes its
    default, so that the doctor runs its checks all the same and reports the error as a
    finding instead of stopping at it.
    """
    app = current_app if app is None else app
    try:
        return get_config(app), None
    except ConfigurationError as exc:
        error = exc
    values: dict[str, Any] = {}
    for field in dataclasses.fields(PglockConfig):
        key, env = f"pglock_{field.name}", f"PGLOCK_{field.name.upper()}"
        try:
            alone = load_config({key: app.conf.get(key)}, {env: os.environ.get(env, "")})
        except ConfigurationError:
            continue
        values[field.name] = getattr(alone, field.name)
    try:
        return PglockConfig(**values), error
    except ConfigurationError:  # valid one by one, not together
        return PglockConfig(), error


def check_settings(error: ConfigurationError | None) -> Iterator[Finding]:
    """The pglock settings (the app's, PGLOCK_* variables) must all be valid: ``error`` if not."""
    if error is not None:
        yield Finding(
            "settings",
            "fail",
            str(error),
            "set each setting named to one of the values given: a worker refuses to start with it",
        )
    else:
        yield Finding("settings", "ok", "every pglock setting is valid")


def run_checks(
    dsn: str,
    *,
    lock_sessions: int = 0,
    locks: int = 0,
    pooler: str = "none",
    app: Celery | None = None,
    shard: str | None = None,
    budget: Budget | None = None,
) -> list[Finding]:
    """Run every check against ``dsn`` and return the findings in order.

    ``lock_sessions`` and ``locks``: the most lock sessions and locks the fleet
    holds at once (0: unknown, not checked against the server's limits).
    ``pooler``: the ``pglock_pooler`` setting ("session": ``dsn`` goes through a
    session-mode pooler, whose reset of server connections is tried out, unless the
    pooler turns out to be in transaction mode). ``app``: the Celery app whose settings
    are checked (default: the current app; the PGLOCK_* variables in either case). With
    ``pglock_patroni_url`` set, the leader fence is checked too (fence_checks). With
    ``shard``, ``dsn`` is that shard's of ``pglock_shards``, and so is the fence, and
    each finding names the shard. ``budget``: the fleet's processes and concurrency,
    whose sessions are checked against the server's free connections (check_budget).
    """
    prefix = PglockConfig().application_name
    config, invalid = read_settings(app)
    if shard is not None and config.shards is not None:
        config = config.for_named_shard(shard)
    urls = config.patroni_url or ()
    findings: list[Finding] = []
    with _doctor_connect(dsn) as conn:
        # First: behind a transaction pooler the session checks would take a lock that
        # stays on a pooled backend, and judge whichever backend they happen to get.
        pooling = list(check_pooler(conn, dsn, pooler))
        if pooler != "session" or all(f.level != "fail" for f in pooling):
            findings.extend(check_lock_session(dsn, pooler))
            findings.extend(check_pooler_reset(dsn, pooler))
        checks: list[Callable[[], Iterator[Finding]]] = [
            lambda: check_version(conn),
            lambda: check_standby(conn),
            lambda: check_replication(conn),
            lambda: iter(pooling),
            lambda: check_idle_timeouts(conn),
            lambda: check_keepalives(conn),
            lambda: check_connections(conn, lock_sessions),
            lambda: iter(()) if budget is None else check_budget(conn, budget, config),
            lambda: check_capacity(conn, locks, prefix),
            lambda: check_privileges(conn),
            lambda: check_search_path(conn),
            lambda: check_guards(conn),
            lambda: check_settings(invalid),
            lambda: check_shard_maps(conn, config),
        ]
        if config.patroni_url:
            checks.append(lambda: fence_checks(dsn, urls, config.check_interval, config))
        for check in checks:
            findings.extend(check())
    if shard is not None:
        findings = [dataclasses.replace(f, shard=shard) for f in findings]
    return findings
