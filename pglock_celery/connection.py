"""How a lock session is opened: its own connection, keepalives, identity, settings.

A lock session is a dedicated psycopg connection in autocommit mode, opened in
the process that uses it and never taken from an application pool. It
connects with ``target_session_attrs=read-write`` (no lock on a standby) and
sets, for its own session only, the server-side TCP keepalives,
``tcp_user_timeout`` and ``client_connection_check_interval`` that bound how
long a cut-off holder keeps its locks, and turns off the idle timeouts that
would end a session holding a lock between statements.
"""

from __future__ import annotations

import base64
import functools
import math
import os
import socket
import uuid

import psycopg
from psycopg.conninfo import conninfo_to_dict

from .config import PglockConfig
from .dsn import describe_target, redact
from .exceptions import ConfigurationError, LockUnavailable

#: Postgres truncates application_name to NAMEDATALEN - 1 bytes.
APPLICATION_NAME_MAX_BYTES = 63
#: Separates the fields of a lock session's application_name.
FIELD_SEPARATOR = "|"


@functools.lru_cache(maxsize=1)
def _hostname() -> str:
    return socket.gethostname()


def compact_task_id(task_id: str | None) -> str:
    """Return a UUID task id in 23 characters (``~`` + base64url), others as they are."""
    if not task_id:
        return "-"
    try:
        raw = uuid.UUID(task_id).bytes
    except ValueError:
        return task_id
    return "~" + base64.urlsafe_b64encode(raw).decode().rstrip("=")


def expand_task_id(field: str) -> str | None:
    """Undo :func:`compact_task_id`."""
    if field in ("", "-"):
        return None
    if field.startswith("~") and len(field) == 23:
        try:
            return str(uuid.UUID(bytes=base64.urlsafe_b64decode(field[1:] + "==")))
        except ValueError:
            return field
    return field


def application_name(prefix: str, lock: str, task_id: str | None, host: str | None = None) -> str:
    """Return the application_name that identifies a lock session's holder.

    Fields by importance, so the 63-byte cut drops the least useful first:
    ``prefix|lock|pid|task id|host``, the task id compacted when it is a UUID.
    The lock name may itself contain the separator; readers check a candidate
    name against the lock's key.
    """
    host = host if host is not None else _hostname()
    fields = [prefix, lock, str(os.getpid()), compact_task_id(task_id), host]
    encoded = FIELD_SEPARATOR.join(fields).encode()
    # Cut on a character boundary: Postgres would cut bytes blindly.
    return encoded[:APPLICATION_NAME_MAX_BYTES].decode(errors="ignore")


def idle_name(prefix: str) -> str:
    """The application_name of a cached lock session that holds nothing."""
    return f"{prefix}-idle{FIELD_SEPARATOR}{os.getpid()}"


def _session_options(config: PglockConfig, inherited: str | None) -> str:
    settings = {
        "tcp_keepalives_idle": config.server_keepalives_idle,
        "tcp_keepalives_interval": config.server_keepalives_interval,
        "tcp_keepalives_count": config.server_keepalives_count,
        "tcp_user_timeout": int(config.server_tcp_user_timeout * 1000),
        "client_connection_check_interval": int(config.server_connection_check_interval * 1000),
        "idle_session_timeout": 0,
        "idle_in_transaction_session_timeout": 0,
    }
    ours = " ".join(f"-c {name}={value}" for name, value in settings.items())
    return f"{inherited} {ours}" if inherited else ours


def connect_kwargs(config: PglockConfig, app_name: str) -> dict[str, object]:
    """Return the libpq parameters added to the DSN for a lock session."""
    dsn = config.require_dsn()
    try:
        params = conninfo_to_dict(dsn)
    except psycopg.ProgrammingError as exc:
        raise ConfigurationError(
            f"pglock_dsn is not a valid connection string: {redact(str(exc), dsn)}"
        ) from None
    return {
        "autocommit": True,
        "application_name": app_name,
        # libpq counts whole seconds and treats anything below 2 as 2.
        "connect_timeout": max(2, math.ceil(config.connect_timeout)),
        "target_session_attrs": "read-write",
        "keepalives": 1,
        "keepalives_idle": config.keepalives_idle,
        "keepalives_interval": config.keepalives_interval,
        "keepalives_count": config.keepalives_count,
        "tcp_user_timeout": int(config.tcp_user_timeout * 1000),
        "options": _session_options(config, str(params.get("options") or "")),
    }


def open_session(config: PglockConfig, app_name: str) -> psycopg.Connection:
    """Open a dedicated lock session, or raise LockUnavailable saying why."""
    kwargs = connect_kwargs(config, app_name)
    dsn = config.require_dsn()
    try:
        return psycopg.Connection.connect(dsn, **kwargs)  # type: ignore[arg-type]
    except psycopg.Error as exc:
        reason = " ".join(str(exc).split())
        raise LockUnavailable(
            f"cannot open a lock session to {describe_target(dsn)}: {redact(reason, dsn)}"
        ) from exc
