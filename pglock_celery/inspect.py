"""Who holds what: advisory locks in pg_locks joined with pg_stat_activity.

:func:`holder` is the public question "who holds this lock?", and :func:`holder_on`
the same asked on a lock session (a skip's report, the redelivery decision). Both read
``pg_locks`` (any holder, hand-rolled code too): who holds a lock is read from the lock,
never from a session's name. Neither is on the path of a lock taken, checked or released.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import logging
import math
from dataclasses import asdict, dataclass
from typing import Any

import psycopg
from celery import current_app
from psycopg import pq

from . import sql
from .config import PglockConfig, get_config
from .dsn import describe_target, redact
from .exceptions import LockUnavailable, PglockError
from .keys import check_key, check_lock_name, key_to_lock_fields, lock_fields_to_key, lock_key
from .session import (
    APPLICATION_NAME_MAX_BYTES,
    FIELD_SEPARATOR,
    LockSession,
    decode_name,
    expand_task_id,
)

logger = logging.getLogger("pglock_celery.lock")


#: The application_name of holder()'s own short session: not a lock session's.
INSPECT_APPLICATION_NAME = "pglock-celery-inspect"


@dataclass(frozen=True)
class Holder:
    """A session that holds an advisory lock, as Postgres reports it."""

    key: int
    #: The lock name, when the holder's application_name carries it whole.
    name: str | None
    #: True when the application_name was cut and only a name prefix is known.
    name_truncated: bool
    task_id: str | None
    worker_pid: int | None
    worker_host: str | None
    backend_pid: int
    application_name: str
    client_addr: str | None
    backend_start: str | None
    state_change: str | None
    state: str | None
    #: When the lock was granted (ISO 8601), when its session records it; else None
    #: (a hand-rolled or shared session: its backend_start is then the bound).
    locked_at: str | None = None

    def as_dict(self) -> dict[str, Any]:
        """Return the holder as a JSON-serialisable dict."""
        return asdict(self)

    def describe(self) -> str:
        """Say who this is in a log line, with the task id whole (as in ``as_dict()``).

        ``task <id> (process <pid> on <host>, backend <pid>)`` for a task's
        lock, ``process <pid> on <host> (backend <pid>)`` for another lock of
        the library, ``backend <pid> (application_name '...')`` for any other
        session.
        """
        if self.worker_pid is None:
            return f"backend {self.backend_pid} (application_name {self.application_name!r})"
        process = f"process {self.worker_pid} on {self.worker_host or 'an unknown host'}"
        if self.task_id is None:
            return f"{process} (backend {self.backend_pid})"
        return f"task {self.task_id} ({process}, backend {self.backend_pid})"


def parse_application_name(
    app_name: str, key: int, prefix: str | None = None
) -> tuple[str | None, bool, str | None, int | None, str | None]:
    """Split a lock session's application_name into its fields.

    Returns ``(name, name_truncated, task_id, worker_pid, worker_host)`` from
    ``prefix|pid|task id|host|name`` (see session.application_name; the pid field
    may carry the grant time, ``pid.T``). The name is accepted only when it hashes
    to ``key``; a name cut by the 63-byte limit comes back as the prefix that
    survived, with ``name_truncated``.
    Sessions not opened by pglock (another prefix, hand-rolled code) yield
    ``(None, False, None, None, None)``.
    """
    fields = app_name.split(FIELD_SEPARATOR, 4)
    if len(fields) < 4 or (prefix is not None and fields[0] != prefix):
        return None, False, None, None, None
    pid_field = fields[1].partition(".")[0]  # pid, or pid.T with the grant time
    if not pid_field.isdigit():
        return None, False, None, None, None
    pid, task_id = int(pid_field), expand_task_id(fields[2])
    host = fields[3] or None
    if len(fields) < 5:
        return None, False, task_id, pid, None  # cut inside the host: better unknown
    name, complete = decode_name(fields[4])
    if name == f"#{key}":
        return None, False, task_id, pid, host  # a lock taken by key, without a name
    if complete and lock_key(name) == key:
        return name, False, task_id, pid, host
    if len(app_name.encode()) >= APPLICATION_NAME_MAX_BYTES - 4:
        return name or None, True, task_id, pid, host
    return None, False, task_id, pid, host


def locked_at(app_name: str, backend_start: dt.datetime | None) -> dt.datetime | None:
    """When a lock session's lock was granted: its ``backend_start`` plus the seconds its
    application_name records (``prefix|pid.T|...``, see session.stamped); else None."""
    fields = app_name.split(FIELD_SEPARATOR, 2)
    if backend_start is None or len(fields) < 3:
        return None
    _, dot, since = fields[1].partition(".")
    try:
        return backend_start + dt.timedelta(seconds=int(since, 16)) if dot else None
    except ValueError:
        return None


def _iso(value: dt.datetime | None) -> str | None:
    return value.isoformat() if value is not None else None


def holder_from_row(row: tuple[Any, ...], prefix: str | None = None) -> Holder:
    """Build a Holder from a row of the held-locks query."""
    classid, objid, pid, app_name, addr, started, changed, state = row
    key = lock_fields_to_key(classid, objid)
    name, truncated, task_id, worker_pid, worker_host = parse_application_name(
        app_name or "", key, prefix
    )
    return Holder(
        key=key,
        name=name,
        name_truncated=truncated,
        task_id=task_id,
        worker_pid=worker_pid,
        worker_host=worker_host,
        backend_pid=pid,
        application_name=app_name or "",
        client_addr=addr,
        backend_start=_iso(started),
        state_change=_iso(changed),
        state=state,
        locked_at=_iso(locked_at(app_name or "", started)),
    )


def find_holder(conn: psycopg.Connection, key: int) -> Holder | None:
    """Return who holds the advisory lock ``key`` in this database, or None."""
    row = conn.execute(sql.HOLDER_OF_KEY, key_to_lock_fields(key)).fetchone()
    return holder_from_row(row) if row is not None else None


def text_holder(key: int, row: list[bytes | None], name: str | None = None) -> Holder:
    """Build a Holder from a row of sql.KEYED_HOLDER (text values).

    ``name`` is the name asked for (its key is what the server checked); without it,
    what the holder's application_name says.
    """

    def text(value: bytes | None) -> str | None:
        return value.decode() if value is not None else None

    pid, app_name, addr, started, changed, state = row
    app_name_text = text(app_name) or ""
    found, truncated, task_id, worker_pid, worker_host = parse_application_name(app_name_text, key)
    if name is not None:
        found, truncated = (None if name == f"#{key}" else name), False
    return Holder(
        key=key,
        name=found,
        name_truncated=truncated,
        task_id=task_id,
        worker_pid=worker_pid,
        worker_host=worker_host,
        backend_pid=int(pid) if pid is not None else 0,
        application_name=app_name_text,
        client_addr=text(addr),
        backend_start=text(started),
        state_change=text(changed),
        state=text(state),
        locked_at=_iso(locked_at(app_name_text, _parsed(text(started)))),
    )


def _parsed(value: str | None) -> dt.datetime | None:
    try:
        return dt.datetime.fromisoformat(value) if value else None
    except ValueError:
        return None


def holder(name_or_key: str | int, *, dsn: str | None = None) -> Holder | None:
    """Return who holds the lock ``name_or_key`` now, or None when it is free.

    Any session holding its key is found, hand-rolled code's too (``pg_locks``
    of the database). Asked by name, the holder carries that name whole (the
    key is what is checked, never a prefix of a cut application_name); asked
    by key, the name is what its application_name shows, if anything. Without
    ``dsn``, the current Celery app's ``pglock_dsn``, else ``PGLOCK_DSN``, as
    for try_lock (a moving name during a change of the shards: its previous shard,
    then its new one). Opens one short plain session (never a lock session) for each
    and closes it; raises LockUnavailable when a database cannot be asked.
    """
    if isinstance(name_or_key, str):
        name: str | None = check_lock_name(name_or_key)
        key = lock_key(name_or_key)
    else:
        name, key = None, check_key(name_or_key)
    label = name if name is not None else f"#{key}"
    whole = get_config(current_app).with_dsn(dsn)
    # During a change of the shards a moving name is held on its previous shard too
    # (by an old-map worker, say): asked there first, as a lock takes it.
    found = None
    for config in (whole.previous_for_key(key, name), whole.for_key(key, name)):
        if config is None:
            continue
        target = config.require_dsn()
        try:
            with _plain_session(config) as conn:
                found = find_holder(conn, key)
        except psycopg.Error as exc:
            reason = " ".join(str(exc).split())
            raise LockUnavailable(
                f"cannot ask {describe_target(target)} who holds lock {label}: "
                f"{redact(reason, target)}"
            ) from exc
        if found is not None:
            break
    if found is None or name is None:
        return found
    return dataclasses.replace(found, name=name, name_truncated=False)


def database_identity(config: PglockConfig) -> str | None:
    """Return which database of which running server ``config``'s DSN reaches.

    The server's start and the database's oid (sql.DATABASE_OF): equal for two DSNs
    only when their locks live in the same database, however each names the server.
    None when the server cannot be asked (the caller then stays in doubt).
    """
    try:
        with _plain_session(config) as conn:
            row = conn.execute(sql.DATABASE_IDENTITY).fetchone()
    except (psycopg.Error, PglockError):
        return None
    return str(row[0]) if row is not None else None


def _plain_session(config: PglockConfig) -> psycopg.Connection[Any]:
    """A short plain session to ``config``'s database, never a lock session."""
    return psycopg.connect(
        config.require_dsn(),
        autocommit=True,
        # libpq counts whole seconds and treats anything below 2 as 2.
        connect_timeout=max(2, math.ceil(config.connect_timeout)),
        application_name=INSPECT_APPLICATION_NAME,
    )


def list_holders(conn: psycopg.Connection) -> list[Holder]:
    """Return every bigint advisory lock held in this database."""
    return [holder_from_row(row) for row in conn.execute(sql.ALL_HELD).fetchall()]


def holder_on(session: LockSession, key: int, label: str) -> Holder | None:
    """Who holds ``label`` now, asked on ``session``; None when nobody can be found.

    Read from the lock itself (pg_locks, granted), never from a session's name: a
    session named for the lock may only wait for it (``connect`` names a session at
    open), or have lost it. The holder carries ``label`` whole (its key is what the
    server checked), as holder() does.
    """
    fields = key_to_lock_fields(key)
    try:
        result = session.query(*sql.KEYED_HOLDER, [str(f).encode() for f in fields])
    except psycopg.Error as exc:
        logger.warning(
            "lock %s: could not look up its holder: %s",
            label,
            " ".join(str(exc).split()),
            extra={"lock": label, "key": key},
        )
        return None
    return text_holder(key, _first_row(result), label) if result.ntuples else None


def _first_row(result: pq.abc.PGresult) -> list[bytes | None]:
    return [result.get_value(0, column) for column in range(result.nfields)]
