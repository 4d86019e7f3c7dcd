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
import secrets
import socket
import uuid
from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict

from . import sessions
from .config import PglockConfig
from .dsn import describe_target, redact
from .exceptions import ConfigurationError, LockUnavailable
from .handles import SessionConnection
from .lock_session import LockSession

#: Postgres truncates application_name to NAMEDATALEN - 1 bytes.
APPLICATION_NAME_MAX_BYTES = 63
#: Separates the fields of a lock session's application_name.
FIELD_SEPARATOR = "|"
#: Starts a lock name written in base64url (see encode_name).
ENCODED_NAME_MARK = "="
#: A session setting carrying a per-session token in the startup options.
SESSION_TOKEN_SETTING = "pglock.session"
#: Ends a host name cut to fit application_name.
CUT_HOST_MARK = "~"


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


def encode_name(name: str) -> str:
    """Return a lock name as Postgres keeps it in application_name: printable ASCII.

    Postgres replaces anything else with ``?`` (16 and later with escapes), so
    such a name, or one starting with ``=``, is written as ``=`` + base64url.
    """
    if name.isascii() and name.isprintable() and not name.startswith(ENCODED_NAME_MARK):
        return name
    encoded = base64.urlsafe_b64encode(name.encode()).decode().rstrip("=")
    return ENCODED_NAME_MARK + encoded


def decode_name(field: str) -> tuple[str, bool]:
    """Undo :func:`encode_name`; return ``(name, complete)``.

    A field cut short decodes to the longest prefix that survived, with
    ``complete`` False when the encoded form cannot be whole.
    """
    if not field.startswith(ENCODED_NAME_MARK):
        return field, True
    body = field[1:]
    usable = len(body) - len(body) % 4 if len(body) % 4 == 1 else len(body)
    try:
        raw = base64.urlsafe_b64decode(body[:usable] + "=" * (-usable % 4))
    except ValueError:
        return "", False
    text = raw.decode(errors="ignore")
    return text, usable == len(body) and text.encode() == raw


def application_name(prefix: str, lock: str, task_id: str | None, host: str | None = None) -> str:
    """Return the application_name that identifies a lock session's holder.

    ``prefix|pid|task id|host|name``: who holds it comes first, so the 63-byte
    cut only ever shortens the name (a skipping caller knows the name anyway:
    it asked for the same key). The task id is compacted when it is a UUID; a
    host too long for the rest is cut and ends with ``~``; the name is encoded
    by :func:`encode_name`.
    """
    return _application_name(prefix, lock, task_id, host, os.getpid())


@functools.lru_cache(maxsize=1024)
def _application_name(
    prefix: str, lock: str, task_id: str | None, host: str | None, pid: int
) -> str:
    host = host if host is not None else _hostname()
    head = FIELD_SEPARATOR.join((prefix, str(pid), compact_task_id(task_id)))
    room = APPLICATION_NAME_MAX_BYTES - len(head) - 2  # two separators around the host
    if len(host.encode()) > room:
        host = host.encode()[: max(room - 1, 0)].decode(errors="ignore") + CUT_HOST_MARK
    encoded = FIELD_SEPARATOR.join((head, host, encode_name(lock))).encode()
    return encoded[:APPLICATION_NAME_MAX_BYTES].decode(errors="ignore")


def idle_name(prefix: str) -> str:
    """The application_name of a cached lock session that holds nothing."""
    return f"{prefix}-idle{FIELD_SEPARATOR}{os.getpid()}"


def _server_settings(config: PglockConfig) -> dict[str, int]:
    """The server settings a lock session needs in force, for its own session only."""
    return {
        "tcp_keepalives_idle": config.server_keepalives_idle,
        "tcp_keepalives_interval": config.server_keepalives_interval,
        "tcp_keepalives_count": config.server_keepalives_count,
        "tcp_user_timeout": int(config.server_tcp_user_timeout * 1000),
        "client_connection_check_interval": int(config.server_connection_check_interval * 1000),
        "idle_session_timeout": 0,
        "idle_in_transaction_session_timeout": 0,
    }


def _session_options(config: PglockConfig, inherited: str | None, token: str) -> str:
    settings: dict[str, object] = {**_server_settings(config), SESSION_TOKEN_SETTING: token}
    ours = " ".join(f"-c {name}={value}" for name, value in settings.items())
    return f"{inherited} {ours}" if inherited else ours


def connect_kwargs(config: PglockConfig, app_name: str, token: str = "-") -> dict[str, object]:
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
        "options": _session_options(config, str(params.get("options") or ""), token),
    }


def open_session(config: PglockConfig, app_name: str) -> LockSession:
    """Open a dedicated lock session and prove it, or raise LockUnavailable saying why."""
    token = secrets.token_hex(8)
    kwargs = connect_kwargs(config, app_name, token)
    dsn = config.require_dsn()
    where = describe_target(dsn)
    with sessions.opening():
        try:
            conn = SessionConnection.connect(dsn, **kwargs)  # type: ignore[arg-type]
        except psycopg.Error as exc:
            reason = " ".join(str(exc).split())
            raise LockUnavailable(
                f"cannot open a lock session to {where}: {redact(reason, dsn)}"
            ) from exc
        try:
            backend_pid, pooled = _verify_session(conn, config, token)
        except psycopg.Error as exc:
            conn.close()
            reason = " ".join(str(exc).split())
            raise LockUnavailable(
                f"the lock session to {where} failed its checks: {redact(reason, dsn)}"
            ) from exc
        except BaseException:
            conn.close()
            raise
        session = LockSession(conn, dsn, backend_pid=backend_pid, token=token, pooled=pooled)
        sessions.register(session)
    return session


def _verify_session(
    conn: psycopg.Connection[Any], config: PglockConfig, token: str
) -> tuple[int, bool]:
    """Prove that ``conn`` is a backend of its own with our settings.

    Returns the server's backend pid and whether the session goes through a pooler.

    A session lock belongs to one server backend. Connected directly, the
    backend's pid is the one libpq got at startup, and the startup options
    (our settings and a per-session token) are in force. Anything in between
    shows as a different pid or missing options: a transaction-mode pooler
    would hand each statement to any backend, so that is refused unless
    ``pglock_pooler = "session"`` says the pooler keeps one backend per client;
    then the settings are applied with set_config and the session is never reused.
    """
    row = conn.execute(
        "SELECT pg_backend_pid(), current_setting(%s, true)",
        (SESSION_TOKEN_SETTING,),
    ).fetchone()
    assert row is not None
    backend_pid, seen = row
    if backend_pid == conn.info.backend_pid and seen == token:
        return backend_pid, False
    if config.pooler != "session":
        conn.close()
        found = (
            "its startup options were dropped"
            if seen != token
            else f"its backend pid {backend_pid} is not the pid {conn.info.backend_pid} "
            "the connection reported"
        )
        raise LockUnavailable(
            f"the lock session to {describe_target(config.require_dsn())} is not a backend "
            f"of its own ({found}): a pooler sits in between, and a transaction-mode pooler "
            "would lose session locks. Connect to Postgres directly, or set "
            'pglock_pooler = "session" if it is a session-mode pooler'
        )
    apply_settings(conn, config, token)
    return backend_pid, True


def apply_settings(conn: psycopg.Connection[Any], config: PglockConfig, token: str) -> None:
    """Set a lock session's settings and token with set_config (behind a session pooler)."""
    settings = {**_server_settings(config), SESSION_TOKEN_SETTING: token}
    calls = ", ".join("set_config(%s, %s, false)" for _ in settings)
    params: list[object] = []
    for name, value in settings.items():
        params += [name, str(value)]
    conn.execute(f"SELECT {calls}", params)
