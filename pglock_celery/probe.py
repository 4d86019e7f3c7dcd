"""The server's own view of a lock session that is busy, asked from outside it.

A check between statements asks the session itself (sql.CHECK). A session busy in
a holder's statement, pipeline, COPY or transaction cannot be asked without
waiting for the holder, or disturbing what it does; a session waiting for its
lock cannot be asked at all. The server is asked instead, on a session of the
library's own per server (a :class:`Probe`, made by the source on first need, to
the very host and port the lock session is on):

- is it still the server the session was opened on (its start time)? Another
  start means a restart, which no session survives;
- is the session's backend still there (its pid and its start time)?
- is the lock's key free? A shared pin of it is only tried: refused while anyone
  holds the key, and granted (for that statement alone) only when nobody does,
  which proves the session lost it. A refusal proves nothing more: the session,
  or whoever took the key after it, holds it; the session's next check between
  statements says which.

A server that does not answer within the statement deadline is a loss the library
cannot rule out (``cannot tell``): the session is treated as lost, as failing
closed requires. A server that answers with an error (no free connection slot,
say) gives no verdict: it is alive, and the session's own socket still speaks for
it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable
from typing import Literal

import psycopg
from psycopg import pq
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from . import sql
from .config import PglockConfig
from .exceptions import LockUnavailable
from .loss import Loss, LossKind, lock_gone, session_ended
from .monitor import one_line
from .session import FIELD_SEPARATOR, STATEMENT_DEADLINE, LockSession, open_session

logger = logging.getLogger("pglock_celery.lock")


def server_of(session: LockSession) -> tuple[str, int, str]:
    """The host (or socket directory), port and address the session is connected to
    (the address '' over a Unix socket)."""
    info = session.conn.info
    try:
        address = info.hostaddr
    except psycopg.NotSupportedError:  # a libpq older than 12
        address = ""
    return info.host, int(info.port), address


def pinned_dsn(dsn: str, host: str, port: int, address: str = "") -> str:
    """``dsn`` with its host list narrowed to one ``host`` and ``port`` (the rest kept),
    at the very ``address`` the session reached when given: a name that resolves
    elsewhere (or not at all) would probe another server."""
    params = conninfo_to_dict(dsn)
    params.pop("hostaddr", None)
    params.update(host=host, port=str(port))
    if address:
        params["hostaddr"] = address
    return make_conninfo("", **params)


class Probe:
    """A session of the library's own on one server, for the server's view of others."""

    def __init__(
        self,
        config: PglockConfig,
        host: str,
        port: int,
        address: str,
        opening: Callable[[PglockConfig], contextlib.AbstractContextManager[None]],
    ) -> None:
        self._config = config.with_dsn(pinned_dsn(config.require_dsn(), host, port, address))
        self._prefix = f"{config.application_name}-probe{FIELD_SEPARATOR}"
        # The registry's opening() (a fork waits for a session being opened).
        self._opening = opening
        self._session: LockSession | None = None
        # One question at a time on the probe's session.
        self._mutex = threading.Lock()

    def judge(self, session: LockSession, key: int | None) -> tuple[Loss | None, bytes | None]:
        """The server's verdict on ``session`` (and on ``key``, when it holds one), and,
        when its backend waits for synchronous replication (a commit), which statement
        waits (its start: one wait from two checks that see the same)."""
        assert session.server_started is not None and session.backend_started is not None
        params = (
            str(session.server_started).encode(),
            str(session.backend_pid).encode(),
            str(session.backend_started).encode(),
            None if key is None else str(key).encode(),
        )
        try:
            result = self._ask(sql.PROBE, params)
        except (psycopg.Error, LockUnavailable) as exc:
            return self._unanswered(exc), None
        same_server, waits_for, key_free = (result.get_value(0, n) for n in range(3))
        if same_server != b"t":
            return session_ended(
                "the lock session's server was restarted (its start time changed), "
                "which ends every session"
            ), None
        if waits_for is None:
            return session_ended("the server no longer has the lock session's backend"), None
        if key_free == b"t":
            return lock_gone("the server shows the lock free while its session is busy"), None
        event, _, statement = waits_for.partition(b" ")
        return None, (statement if event == b"SyncRep" else None)

    def end_backend(self, session: LockSession, timeout: float) -> bool:
        """End ``session``'s backend on the server and wait up to ``timeout`` s for it to exit.

        For a session that a holder's statement keeps busy: once this returns True
        the backend is gone, with its locks, and nothing it was running commits.
        False when the server did not confirm it in time (or could not be asked).
        """
        assert session.backend_started is not None
        params = (
            str(session.backend_pid).encode(),
            str(session.backend_started).encode(),
            str(max(1, round(timeout * 1000))).encode(),
        )
        try:
            result = self._ask(sql.END_BACKEND, params, deadline=timeout + STATEMENT_DEADLINE)
        except (psycopg.Error, LockUnavailable) as exc:
            logger.warning("the lock probe could not end a busy session: %s", one_line(exc))
            return False
        return result.get_value(0, 0) == b"t"

    def _ask(
        self,
        statement: sql.Statement,
        params: tuple[bytes | None, ...],
        deadline: float | Literal["default"] = "default",
    ) -> pq.abc.PGresult:
        """Run ``statement`` on the probe's session, opened on first need (and closed
        when the statement fails, to be opened afresh next time)."""
        with self._mutex:
            try:
                return self._open().query(*statement, params, deadline=deadline)
            except (psycopg.Error, LockUnavailable):
                self._drop()
                raise

    def _unanswered(self, exc: BaseException) -> Loss | None:
        cause = exc.__cause__ if isinstance(exc, LockUnavailable) else exc
        if isinstance(cause, psycopg.Error) and cause.sqlstate is not None:
            # The server answered, with an error: alive, so no verdict of its own.
            logger.warning("the lock probe got no verdict: %s", one_line(exc))
            return None
        return Loss(
            LossKind.CANNOT_TELL,
            f"the server did not answer the library's probe of the busy lock session: "
            f"{one_line(exc)}",
        )

    def _open(self) -> LockSession:
        if self._session is None or self._session.closed:
            with self._opening(self._config):
                self._session = open_session(
                    self._config, f"{self._prefix}{os.getpid()}", takes_locks=False
                )
        return self._session

    def _drop(self) -> None:
        if self._session is not None:
            self._session.close()
            self._session = None

    def close(self) -> None:
        with self._mutex:
            self._drop()

    def forget_after_fork(self) -> None:
        """In a forked child: the parent's probe session is the parent's."""
        self._mutex = threading.Lock()
        if self._session is not None:
            self._session.forget_after_fork()
            self._session = None
