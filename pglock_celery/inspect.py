"""Who holds what: advisory locks in pg_locks joined with pg_stat_activity."""

from __future__ import annotations

import datetime as dt
from dataclasses import asdict, dataclass
from typing import Any

import psycopg

from .connection import APPLICATION_NAME_MAX_BYTES, FIELD_SEPARATOR, expand_task_id
from .keys import key_to_lock_fields, lock_fields_to_key, lock_key

# Advisory locks are per database; a bigint key shows as classid/objid with
# objsubid = 1 (two int4 keys use objsubid = 2 and are not ours).
_HELD_LOCKS = """
SELECT l.classid::int8, l.objid::int8, a.pid, a.application_name,
       host(a.client_addr), a.backend_start, a.state_change, a.state
FROM pg_locks l
JOIN pg_stat_activity a ON a.pid = l.pid
WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1
  AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
"""

HOLDER_OF_KEY = _HELD_LOCKS + " AND l.classid = %s::int8::oid AND l.objid = %s::int8::oid"
ALL_HELD = _HELD_LOCKS + " ORDER BY a.backend_start, a.pid"


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

    def as_dict(self) -> dict[str, Any]:
        """Return the holder as a JSON-serialisable dict."""
        return asdict(self)


def parse_application_name(
    app_name: str, key: int, prefix: str | None = None
) -> tuple[str | None, bool, str | None, int | None, str | None]:
    """Split a lock session's application_name into its fields.

    Returns ``(name, name_truncated, task_id, worker_pid, worker_host)``. The
    name is accepted only when it hashes to ``key``; a name cut by the 63-byte
    limit comes back as the prefix that survived, with ``name_truncated``, and
    a field the cut may have shortened is dropped rather than shown wrong.
    Sessions not opened by pglock (another prefix, hand-rolled code) yield
    ``(None, False, None, None, None)``.
    """
    fields = app_name.split(FIELD_SEPARATOR)
    if len(fields) < 2 or (prefix is not None and fields[0] != prefix):
        return None, False, None, None, None
    maybe_cut = len(app_name.encode()) > APPLICATION_NAME_MAX_BYTES - 4
    # The name may contain the separator: find how many fields it spans.
    for end in range(2, len(fields) + 1):
        candidate = FIELD_SEPARATOR.join(fields[1:end])
        bare = candidate == f"#{key}"  # a lock taken by key, without a name
        if bare or lock_key(candidate) == key:
            rest = fields[end:]
            if maybe_cut and rest:
                rest = rest[:-1]
            pid = int(rest[0]) if rest and rest[0].isdigit() else None
            task_id = expand_task_id(rest[1]) if len(rest) > 1 else None
            host = rest[2] or None if len(rest) > 2 else None
            return (None if bare else candidate), False, task_id, pid, host
    if maybe_cut:
        return FIELD_SEPARATOR.join(fields[1:]), True, None, None, None
    return None, False, None, None, None


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
    )


def find_holder(conn: psycopg.Connection, key: int) -> Holder | None:
    """Return who holds the advisory lock ``key`` in this database, or None."""
    row = conn.execute(HOLDER_OF_KEY, key_to_lock_fields(key)).fetchone()
    return holder_from_row(row) if row is not None else None


def list_holders(conn: psycopg.Connection) -> list[Holder]:
    """Return every bigint advisory lock held in this database."""
    return [holder_from_row(row) for row in conn.execute(ALL_HELD).fetchall()]
