"""One lock session: how it is opened (keepalives, bounds, identity) and how it is used.

A lock session is a dedicated libpq connection in autocommit mode, opened in the
process that uses it and never taken from an application pool. It connects with
``target_session_attrs=read-write`` (no lock on a standby) and sets, for its own
session only, the server-side TCP keepalives, ``tcp_user_timeout`` and
``client_connection_check_interval`` that bound how long a cut-off holder keeps
its locks; it turns off the idle timeouts that would end a session holding a lock
between statements, and the statement bounds of a role that would cancel a wait.

A :class:`LockSession` talks to its server through a private psycopg connection
that no holder ever sees, with the statements of sql.py prepared under their own
names (:meth:`LockSession.query`); a holder gets a handle of its own
(:meth:`LockSession.handle`, see handles.py), so every client-side attribute
starts at its default, and every handle is revoked at release. One re-entrant
lock per session (its guard) serialises the handles, the library's statements
and the loss checks.

Where sessions come from (a new one per lock, an idle one, a shared one) is the
business of sources/; this module knows nothing of it.
"""

from __future__ import annotations

import _socket
import base64
import contextlib
import functools
import math
import os
import secrets
import socket
import sys
import time
import uuid
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Literal

import psycopg
from psycopg import errors, generators, pq, waiting
from psycopg.abc import PQGen
from psycopg.conninfo import conninfo_to_dict

from . import sql
from .config import PglockConfig
from .dsn import describe_target, redact
from .exceptions import ConfigurationError, LockUnavailable
from .handles import (
    HandleConnection,
    Revoked,
    SessionConnection,
    SessionGuard,
    dead_pgconn,
    finish_interrupted,
    green_wait,
)
from .leader import ServerIdentity
from .rollout import enter

#: Postgres truncates application_name to NAMEDATALEN - 1 bytes.
APPLICATION_NAME_MAX_BYTES = 63
#: Separates the fields of a lock session's application_name.
FIELD_SEPARATOR = "|"
#: Starts a lock name written in base64url (see encode_name).
ENCODED_NAME_MARK = "="
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
    return compose_holder_name(prefix, lock, task_id, os.getpid(), host)


def compose_holder_name(
    prefix: str, lock: str, task_id: str | None, pid: int, host: str | None = None
) -> str:
    """:func:`application_name` for process ``pid``."""
    host = host if host is not None else _hostname()
    head = FIELD_SEPARATOR.join((prefix, str(pid), compact_task_id(task_id)))
    room = APPLICATION_NAME_MAX_BYTES - len(head) - 2  # two separators around the host
    if len(host.encode()) > room:
        host = host.encode()[: max(room - 1, 0)].decode(errors="ignore") + CUT_HOST_MARK
    encoded = FIELD_SEPARATOR.join((head, host, encode_name(lock))).encode()
    return encoded[:APPLICATION_NAME_MAX_BYTES].decode(errors="ignore")


#: :func:`compose_holder_name`, cached for names met again and again (a tenant's every step).
holder_name = functools.lru_cache(maxsize=1024)(compose_holder_name)


def stamped(app_name: str, session: LockSession) -> bytes:
    """``app_name`` with the lock's grant time, for the server: ``prefix|pid.T|...``.

    ``T`` is the whole seconds since the session opened, in hex: ``locks`` adds it to
    the session's ``backend_start`` (pg_stat_activity), so a lock taken on a reused
    session shows its own age. Cut again to 63 bytes: the name's tail may go.
    """
    prefix, _, rest = app_name.partition(FIELD_SEPARATOR)
    pid, _, tail = rest.partition(FIELD_SEPARATOR)
    since = int(time.time() - session.opened_at)
    text = f"{prefix}{FIELD_SEPARATOR}{pid}.{since:x}{FIELD_SEPARATOR}{tail}"
    return text.encode()[:APPLICATION_NAME_MAX_BYTES]


def idle_name(prefix: str) -> str:
    """The application_name of a cached lock session that holds nothing."""
    return f"{prefix}-idle{FIELD_SEPARATOR}{os.getpid()}"


def _server_settings(config: PglockConfig) -> dict[str, int | str]:
    """The server settings a lock session needs in force, for its own session only.

    A role's statement_timeout or lock_timeout would cancel a wait that only the
    caller's timeout may end, and its idle timeouts would end a session holding a
    lock between statements. With ``pglock_database``, the session starts in the time
    zone Django gives the alias's connections: the body's connection then needs no
    set-up of its own, and the release's DISCARD ALL returns to it. (Nothing of the
    library's reads a time as text: its times are instants, whatever the zone.)
    """
    settings: dict[str, int | str] = {
        "tcp_keepalives_idle": config.server_keepalives_idle,
        "tcp_keepalives_interval": config.server_keepalives_interval,
        "tcp_keepalives_count": config.server_keepalives_count,
        "tcp_user_timeout": int(config.server_tcp_user_timeout * 1000),
        "client_connection_check_interval": int(config.server_connection_check_interval * 1000),
        "idle_session_timeout": 0,
        "idle_in_transaction_session_timeout": 0,
        "statement_timeout": 0,
        "lock_timeout": 0,
    }
    if config.database is not None:
        from .django import time_zone

        if zone := time_zone(config.database):
            settings["TimeZone"] = zone
    return settings


def _option(value: object) -> str:
    """A value as libpq's ``options`` reads it: a space or a backslash escaped."""
    return str(value).replace("\\", "\\\\").replace(" ", "\\ ")


def _session_options(config: PglockConfig, inherited: str | None, token: str) -> str:
    settings: dict[str, object] = {**_server_settings(config), sql.SESSION_TOKEN_SETTING: token}
    ours = " ".join(f"-c {name}={_option(value)}" for name, value in settings.items())
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


@functools.lru_cache(maxsize=64)
def _addresses(dsn: str) -> int:
    """How many addresses libpq may try for ``dsn`` (each host's, one per socket directory)."""
    try:
        params = conninfo_to_dict(dsn)
    except psycopg.ProgrammingError:
        return 1
    hosts = str(params.get("hostaddr") or params.get("host") or "").split(",")
    ports = str(params.get("port") or "5432").split(",")
    count = 0
    for at, host in enumerate(hosts):
        port = ports[at] if at < len(ports) else ports[-1]
        if not host or host.startswith("/") or params.get("hostaddr"):
            count += 1
            continue
        try:
            found = socket.getaddrinfo(host, port or None, type=socket.SOCK_STREAM)
        except (OSError, UnicodeError):
            found = []
        count += max(1, len({address[4] for address in found}))
    return max(1, count)


def open_bound(config: PglockConfig) -> float:
    """The longest an open_session can take, in seconds: what a fork may wait for.

    libpq gives each address it tries the whole connect timeout (whole seconds, at
    least 2); then the session's checks each have the statement deadline.
    """
    per_address = max(2, math.ceil(config.connect_timeout))
    deadline = max(STATEMENT_DEADLINE, config.tcp_user_timeout)
    return _addresses(config.require_dsn()) * per_address + 2 * deadline


def open_session(
    config: PglockConfig,
    app_name: str,
    identify: Callable[[psycopg.Connection[Any]], ServerIdentity] | None = None,
    *,
    takes_locks: bool = True,
) -> LockSession:
    """Open a dedicated lock session and prove it, or raise LockUnavailable saying why.

    With ``identify`` (a leader source's), the session learns which server it is on
    (``session.identity``) before it is used. Call it inside the registry's
    ``opening()`` (sources/): a fork meanwhile waits. A session that never
    ``takes_locks`` (a probe's) records its map but is not refused for it.
    """
    token = secrets.token_hex(8)
    kwargs = connect_kwargs(config, app_name, token)
    dsn = config.require_dsn()
    where = describe_target(dsn)
    opened_at = time.time()  # before the backend starts: a grant is never shown later
    try:
        conn = SessionConnection.connect(dsn, **kwargs)  # type: ignore[arg-type]
    except psycopg.Error as exc:
        reason = " ".join(str(exc).split())
        raise LockUnavailable(
            f"cannot open a lock session to {where}: {redact(reason, dsn)}"
        ) from exc
    # The library's own statements on it never wait for ever on a frozen server.
    conn.statement_deadline = max(STATEMENT_DEADLINE, config.tcp_user_timeout)
    try:
        backend_pid, pooled, started, recorded = _verify_session(conn, config, token)
        _enter_map(conn, config, recorded, where, refusable=takes_locks)
        identity = identify(conn) if identify is not None else None
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
    session.backend_started, session.server_started = started
    session.opened_at = opened_at
    session.identity = identity
    session.statement_deadline = max(STATEMENT_DEADLINE, config.tcp_user_timeout)
    return session


def _enter_map(
    conn: psycopg.Connection[Any],
    config: PglockConfig,
    recorded: bool,
    where: str,
    *,
    refusable: bool,
) -> None:
    """Where the database keeps the record of the shard maps, record this session's
    and refuse it if its map is not accepted (rollout.py); a transition's session
    refuses a database without the record (its rollout was not begun there)."""
    identity = config.map_identity
    if identity is None:
        return
    if recorded:
        enter(conn, identity, where, config.require_dsn(), refusable=refusable)
    elif identity.transition and refusable:
        raise LockUnavailable(
            f"this worker runs a change of pglock_shards (pglock_shards_previous is set), "
            f"and {where} keeps no record of the shard maps: run `pglock-celery shards "
            "begin` with this configuration first"
        )


def _verify_session(
    conn: psycopg.Connection[Any], config: PglockConfig, token: str
) -> tuple[int, bool, tuple[int, int], bool]:
    """Prove that ``conn`` is a backend of its own with our settings.

    Returns the server's backend pid, whether the session goes through a pooler,
    when its backend and its server started (microseconds, for probe.py), and whether
    the database keeps the record of the shard maps.

    A session lock belongs to one server backend. Connected directly, the
    backend's pid is the one libpq got at startup, and the startup options
    (our settings and a per-session token) are in force. Anything in between
    shows as a different pid or missing options: a transaction-mode pooler
    would hand each statement to any backend, so that is refused unless
    ``pglock_pooler = "session"`` says the pooler keeps one backend per client;
    then the settings are applied with set_config and the session is never reused.
    """
    row = conn.execute(sql.VERIFY_SESSION, (sql.SESSION_TOKEN_SETTING,)).fetchone()
    assert row is not None
    backend_pid, seen, backend_started, server_started, recorded = row
    started = (backend_started, server_started)
    if backend_pid == conn.info.backend_pid and seen == token:
        return backend_pid, False, started, recorded
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
    return backend_pid, True, started, recorded


def apply_settings(conn: psycopg.Connection[Any], config: PglockConfig, token: str) -> None:
    """Set a lock session's settings and token with set_config (behind a session pooler)."""
    settings = {**_server_settings(config), sql.SESSION_TOKEN_SETTING: token}
    params: list[object] = []
    for name, value in settings.items():
        params += [name, str(value)]
    conn.execute(sql.set_session_settings(len(settings)), params)


#: How much of what the server sent unasked is looked at (a notice or two, an error).
_PEEK_BYTES = 8192
#: Protocol messages that, unasked between statements, are the server ending the
#: session: an ErrorResponse (FATAL: terminated, shut down) or a NoticeResponse
#: (WARNING: a crash of another backend resets them all).
_GOODBYES = (b"E", b"N")
#: The least time the library waits for the answer to one of its own statements
#: (pglock_tcp_user_timeout if longer): a server that does not answer is frozen or
#: gone, and a session on it a failed one.
STATEMENT_DEADLINE = 5.0
#: Seconds between wake-ups while waiting for the server (signals are handled then).
_WAIT_INTERVAL = 0.1
#: SQLSTATE of a prepared statement that is not there (a holder deallocated it).
_NO_SUCH_STATEMENT = b"26000"


class LockSession:
    """One dedicated lock session: its socket, the library's connection, its handles."""

    def __init__(
        self,
        conn: psycopg.Connection[Any],
        dsn: str,
        *,
        backend_pid: int,
        token: str,
        pooled: bool,
    ) -> None:
        self.conn = conn
        # Never prepared by psycopg: holders' handles name their prepared statements
        # the same way, and DISCARD ALL drops them all.
        conn.prepare_threshold = None
        self.pgconn = conn.pgconn
        #: Serialises every statement on the session, whoever sends it.
        self.guard = SessionGuard()
        conn.lock = self.guard  # type: ignore[assignment]
        self.dsn = dsn
        #: The process that opened the session: no other may use or close it.
        self.pid = os.getpid()
        #: The server's pid of the backend (behind a pooler, not libpq's).
        self.backend_pid = backend_pid
        #: Behind a session-mode pooler: never reused (see _verify_session).
        self.pooled = pooled
        #: This session's own value of pglock.session: proof a statement ran on it.
        self.token = token
        self._handles: list[psycopg.Connection[Any]] = []
        # The library's statements: run once, then prepared under their own names.
        self._used: set[bytes] = set()
        self._prepared: set[bytes] = set()
        #: Whether a holder got a handle since the session was last reset.
        self.handed_out = False
        #: When the session's backend and its server started (microseconds since
        #: 1970, as the server reports them): how probe.py knows them again.
        self.backend_started: int | None = None
        self.server_started: int | None = None
        #: Seconds the library waits for the answer to one of its statements
        #: (open_session makes it the config's: tcp_user_timeout when longer).
        self.statement_deadline = STATEMENT_DEADLINE
        #: The server the session is on, for the leader source (when configured).
        self.identity: ServerIdentity | None = None
        #: Until when (time.monotonic()) the leader source last confirmed that the
        #: session's server leads; None without a leader source.
        self.confirmed_until: float | None = None
        #: When the session was opened (time.time(), just before its backend started).
        self.opened_at = time.time()
        # How to wait for the server: psycopg's own, or one gevent or eventlet can
        # switch out of (chosen here: green libraries patch before sessions open).
        self._wait = green_wait() or waiting.wait
        # Which socket is the session's (its inode: unique among open sockets), to
        # know it again before cutting it (cut()).
        self._socket_inode = os.fstat(self.pgconn.socket).st_ino
        # What refers to the libpq connection while nobody but the session does (its
        # own attribute and its library connection's): see referenced_elsewhere().
        self._own_references = sys.getrefcount(self.pgconn)
        self._own_weak_references = weakref.getweakrefcount(self.pgconn)

    def __repr__(self) -> str:
        return f"<LockSession backend {self.backend_pid} of process {self.pid}>"

    @property
    def closed(self) -> bool:
        return self.pgconn.status == pq.ConnStatus.BAD

    def handle(self) -> psycopg.Connection[Any]:
        """Return a connection for the holder: pristine client state, dies at revoke."""
        handle = HandleConnection(self.pgconn)
        handle.on_close = self._closed_by_holder
        handle.lock = self.guard  # type: ignore[assignment]
        handle.autocommit = True
        self._handles.append(handle)
        self.handed_out = True
        return handle

    def referenced_elsewhere(self) -> bool:
        """Whether anything but the session refers to its libpq connection (after revoke).

        A holder's code may have kept it (``conn.info.pgconn``, a cursor, a
        transaction or copy object, a pipeline, a weak reference): such a session is
        never handed to another holder, since what was kept could still drive it.
        Decided by what refers to the object, not by who read it. (Code that copies
        the socket's descriptor or libpq's C pointer goes around Python and is out
        of its reach.)
        """
        # Counted exactly as in __init__ (no local name: it would count itself).
        return (
            sys.getrefcount(self.pgconn) > self._own_references
            or weakref.getweakrefcount(self.pgconn) > self._own_weak_references
        )

    def revoke(self, message: str) -> None:
        """Make every handle given out so far fail on its next statement."""
        for handle in list(self._handles):
            self.revoke_one(handle, message)
        # Notices of later holders must not reach a revoked handle's handlers.
        self.pgconn.notice_handler = None
        self.pgconn.notify_handler = None

    def _closed_by_holder(self, handle: psycopg.Connection[Any], message: str) -> None:
        """The holder closed its handle: revoke it, and end its transaction as a close does.

        Closing a psycopg connection rolls back what it had begun; the session
        stays, so the library rolls that transaction back on it (the next handle
        then starts outside any transaction, as a new connection would).
        """
        self.revoke_one(handle, message)
        if self.pgconn.transaction_status in (
            pq.TransactionStatus.INTRANS,
            pq.TransactionStatus.INERROR,
        ):
            with contextlib.suppress(psycopg.Error):
                self.conn.rollback()

    def revoke_one(self, handle: psycopg.Connection[Any], message: str) -> None:
        handle.lock = Revoked(message)  # type: ignore[assignment]
        handle.pgconn = dead_pgconn()
        with contextlib.suppress(ValueError):
            self._handles.remove(handle)

    def alive(self, *, take_guard: bool = True) -> bool:
        """Whether the server still has the session, read from the socket without a statement.

        Safe in any state, from any thread: it only peeks (never consuming what
        libpq or a holder's statement will read), on the session's own socket only
        (a duplicate pins it, known by its inode). Between statements (its guard
        taken here, so none can start meanwhile), anything the server sent unasked
        is its goodbye (an error, or a warning when a crash resets every backend);
        while a statement, a pipeline or a COPY is under way only a FATAL or PANIC
        error, or a connection-ending SQLSTATE (class 57P), is: the rest is the
        holder's results. A closed or reset connection, or one the keepalives found
        dead, is not alive either. Without ``take_guard`` it is judged as while a
        statement is under way: for an OS thread that must not take a green lock
        (monitor.py's native watch under gevent and eventlet).
        """
        if self.pid != os.getpid() or self.pgconn.status == pq.ConnStatus.BAD:
            return False
        quiet = take_guard and self.guard.acquire(blocking=False)
        try:
            pending = self._peek()
            if pending is None:
                return True  # nothing arrived: the usual case
            if not pending:
                return False  # closed, reset, or found dead by the keepalives
            between_statements = (
                quiet
                and self.pgconn.transaction_status in _BETWEEN_STATEMENTS
                and not self.pgconn.pipeline_status
            )
            if self.pgconn.ssl_in_use:
                # Encrypted, it cannot be read without consuming it. Unasked data on an
                # idle session is the server's goodbye in practice (notifications wait
                # for the end of a transaction); otherwise it may be results.
                return not (
                    between_statements
                    and self.pgconn.transaction_status == pq.TransactionStatus.IDLE
                )
            if between_statements:
                return not any(kind in _GOODBYES for kind, _ in _messages(pending))
            return not any(_ends_the_session(kind, body) for kind, body in _messages(pending))
        finally:
            if quiet:
                self.guard.release()

    def _peek(self) -> bytes | None:
        """What the server sent that nobody read yet: None if nothing, b"" if the
        connection is closed or failed (or the descriptor is no longer the session's)."""
        try:
            pinned = os.dup(self.pgconn.socket)
        except (psycopg.Error, OSError):
            return b""
        try:
            if os.fstat(pinned).st_ino != self._socket_inode:
                return b""  # libpq closed it, and the number is another file's now
            # The C socket: gevent's and eventlet's would wait for data instead.
            sock = _socket.socket(fileno=pinned)
            try:
                return sock.recv(_PEEK_BYTES, _socket.MSG_PEEK | _socket.MSG_DONTWAIT)
            except BlockingIOError:
                return None
            except OSError:
                return b""  # reset, or keepalives found the peer gone
            finally:
                sock.detach()
        finally:
            os.close(pinned)

    def guard_is_taken(self) -> bool:
        """Whether a statement of someone's is under way (the guard is held elsewhere)."""
        if self.guard.acquire(blocking=False):
            self.guard.release()
            return False
        return True

    def cut(self) -> None:
        """Shut the session's connection down both ways, without closing its descriptor.

        For a statement that may never be answered (a frozen or deposed server): the
        thread waiting on it wakes at once to an error, nothing more reaches the
        server, and that thread still owns the descriptor (closing it under a wait
        could hand its number to another file). The session is never used again.
        libpq closes the descriptor when the server ends the session, and another
        socket may take its number: a duplicate pins the socket the number names,
        and only the session's own (by inode) is shut down.
        """
        if self.pid != os.getpid() or self.pgconn.status == pq.ConnStatus.BAD:
            return  # a parent's socket is the parent's; a failed one is already cut off
        try:
            pinned = os.dup(self.pgconn.socket)
        except (psycopg.Error, OSError):
            return
        try:
            if os.fstat(pinned).st_ino == self._socket_inode:
                sock = _socket.socket(fileno=pinned)
                try:
                    sock.shutdown(_socket.SHUT_RDWR)
                finally:
                    sock.detach()
        except OSError:
            pass  # not connected any more
        finally:
            os.close(pinned)

    def query(
        self,
        name: bytes,
        text: bytes,
        params: Sequence[bytes | None] = (),
        *,
        deadline: float | Literal["default"] | None = "default",
    ) -> pq.abc.PGresult:
        """Run one of the library's statements; return its result or raise psycopg.Error.

        Straight at the libpq level, waiting as psycopg does (cooperatively
        under gevent and eventlet). A statement is prepared as ``name`` the
        second time the session runs it. A holder may have dropped it
        (DEALLOCATE): then it runs unprepared and is prepared again later. A
        statement unanswered after ``deadline`` seconds (the session's
        ``statement_deadline`` by default; None: no bound) fails and closes the
        session: a server that stopped answering (paused, frozen) is a failed one.
        """
        pgconn = self.pgconn
        if deadline == "default":
            deadline = self.statement_deadline
        with self.guard:
            if self.handed_out:
                # A holder with a handle can DEALLOCATE or PREPARE under our names (its
                # own pglock_check returning "held"): nothing prepared is trusted then.
                pgconn.send_query_params(text, params)
                result = self._result(deadline)
            elif name in self._prepared:
                pgconn.send_query_prepared(name, params)
                result = self._result(deadline)
                if result.error_field(pq.DiagnosticField.SQLSTATE) == _NO_SUCH_STATEMENT:
                    self._prepared.discard(name)
                    pgconn.send_query_params(text, params)
                    result = self._result(deadline)
            elif name in self._used:
                pgconn.send_prepare(name, text)
                if self._result(deadline).status == pq.ExecStatus.COMMAND_OK:
                    self._prepared.add(name)
                    pgconn.send_query_prepared(name, params)
                else:
                    pgconn.send_query_params(text, params)
                result = self._result(deadline)
            else:
                self._used.add(name)
                pgconn.send_query_params(text, params)
                result = self._result(deadline)
        if result.status != pq.ExecStatus.TUPLES_OK:
            raise errors.error_from_result(result, encoding=self.conn.info.encoding)
        return result

    def execute(self, text: bytes) -> None:
        """Run statements of the library that take no parameters (one or several)."""
        with self.guard:
            self.conn.execute(text)

    def unlock_and_reset(self, text: bytes, params: Sequence[bytes]) -> tuple[bytes | None, bool]:
        """The unlock ``text`` (one of the library's statements), then DISCARD ALL, in one
        round trip: libpq's pipeline with a Sync between them (DISCARD ALL cannot run in
        a transaction block, which a multi-statement query is). The unlock goes first:
        DISCARD ALL frees every advisory lock itself, which would hide whether the lock
        was still held. The unlock's first value (psycopg.Error when it failed), and
        whether the reset succeeded (when not, the session is not to be used again). A
        wait cut short (the deadline, an interrupt) closes the session.
        """
        pgconn = self.pgconn
        with self.guard:
            try:
                pgconn.enter_pipeline_mode()
                pgconn.send_query_params(text, params)
                pgconn.pipeline_sync()
                pgconn.send_query_params(sql.RESET_HANDED_OUT, None)
                pgconn.pipeline_sync()
                groups = self._wait(
                    _through_two_syncs(pgconn),
                    pgconn.socket,
                    interval=_WAIT_INTERVAL,
                    timeout=self.statement_deadline,
                )
                pgconn.exit_pipeline_mode()
            except BaseException:
                self.close()  # nothing of a pipeline cut midway can be trusted
                raise
        unlock, reset = groups[0][-1], groups[2][-1]
        if unlock.status != pq.ExecStatus.TUPLES_OK:
            raise errors.error_from_result(unlock, encoding=self.conn.info.encoding)
        reset_done = reset.status == pq.ExecStatus.COMMAND_OK
        if reset_done:
            self.forget_prepared()
        return unlock.get_value(0, 0), reset_done

    def forget_prepared(self) -> None:
        """After DISCARD ALL: the server dropped every prepared statement."""
        self._prepared.clear()
        self._used.clear()

    def _result(self, deadline: float | None) -> pq.abc.PGresult:
        """Wait for the result of the statement just sent, up to ``deadline`` seconds."""
        try:
            generator = generators.execute(self.pgconn)
            results: list[pq.abc.PGresult] = self._wait(
                generator, self.pgconn.socket, interval=_WAIT_INTERVAL, timeout=deadline
            )
        except psycopg.Error as exc:
            if self.pgconn.transaction_status == pq.TransactionStatus.ACTIVE:
                # No answer in time: the server is frozen or gone; nothing of it
                # can be trusted, and a cancel would wait on it too.
                self.close()
                raise psycopg.OperationalError(
                    f"the server did not answer a statement of the library within {deadline:g} s"
                ) from exc
            raise
        except BaseException:
            # Interrupted (a time limit, gevent.Timeout): the statement is cancelled
            # and its end read, so the session serves on (its caller undoes what the
            # statement did); one that cannot be brought back is closed.
            finish_interrupted(self.conn, generator, self._wait)
            if self.pgconn.transaction_status != pq.TransactionStatus.IDLE:
                self.close()
            raise
        return results[-1]

    def close(self) -> None:
        """Close the session (its locks go with it); only in the process that opened it."""
        if self.pid == os.getpid():
            self.conn.close()

    def retire(self, *, now_if_idle: bool = True) -> None:
        """Close the session as soon as no statement is under way on it: now, or as the
        one under way ends (a cut session's statement fails at once). For a session
        found lost: it serves nobody again, and its connection is the library's to close.
        """
        self.guard.close_when_quiet(self.close, now_if_idle=now_if_idle)

    def forget_after_fork(self) -> None:
        """In a forked child: close this process's copy of the socket, never write to it.

        Only the parent's own life then decides when the session ends, and libpq
        never writes a goodbye on a descriptor number the child may reuse.
        """
        if not self.closed:
            with contextlib.suppress(OSError, psycopg.Error):
                os.close(self.pgconn.socket)
        self.revoke("this lock connection belongs to the parent process")
        self.conn.pgconn = dead_pgconn()


def _messages(data: bytes) -> list[tuple[bytes, bytes]]:
    """The protocol messages (type, body) that start ``data`` (type, int32 length, body).

    The last one may be cut short at the end of ``data``.
    """
    messages, at = [], 0
    while at + 5 <= len(data):
        length = int.from_bytes(data[at + 1 : at + 5], "big")
        messages.append((data[at : at + 1], data[at + 5 : at + 1 + length]))
        at += 1 + length
    return messages


#: Transaction states in which no statement is under way on a session.
_BETWEEN_STATEMENTS = (
    pq.TransactionStatus.IDLE,
    pq.TransactionStatus.INTRANS,
    pq.TransactionStatus.INERROR,
)
#: Severities of an ErrorResponse after which the server ends the session.
_FATAL_SEVERITIES = (b"FATAL", b"PANIC")


def _ends_the_session(kind: bytes, body: bytes) -> bool:
    """Whether a message says the server ends the session (seen among a statement's results).

    An ErrorResponse of severity FATAL or PANIC, or a message (error or warning) of
    SQLSTATE class 57P (operator intervention: terminated, shut down, crash reset).
    """
    if kind not in _GOODBYES:
        return False
    fields = {field[:1]: field[1:] for field in body.split(b"\0") if field}
    severity = fields.get(b"V", fields.get(b"S", b""))
    return (kind == b"E" and severity in _FATAL_SEVERITIES) or fields.get(b"C", b"").startswith(
        b"57P"
    )


def _through_two_syncs(pgconn: pq.abc.PGconn) -> PQGen[list[list[pq.abc.PGresult]]]:
    """Flush a pipeline of two statements, each followed by a Sync, and read it whole:
    [first's results], [sync], [second's results], [sync]."""
    yield from generators.send(pgconn)
    groups: list[list[pq.abc.PGresult]] = []
    syncs = 0
    while syncs < 2:
        group = yield from generators.fetch_many(pgconn)
        groups.append(group)
        syncs += any(result.status == pq.ExecStatus.PIPELINE_SYNC for result in group)
    return groups
