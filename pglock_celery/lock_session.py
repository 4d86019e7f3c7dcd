"""One lock session: its socket, the library's statements on it, the holder's handles.

A :class:`LockSession` is one dedicated libpq connection. The library talks to
it through a private psycopg connection that no holder ever sees, with its own
statements prepared under names of their own (:meth:`LockSession.query`); a
holder gets a handle of its own (:meth:`LockSession.handle`, see handles.py), a
fresh psycopg connection over the same socket, so every client-side attribute
starts at its default. At release every handle is revoked: each statement
through it, or through a cursor made from it, fails from then on. One statement
at a time may be sent without waiting for its answer (:meth:`LockSession.send`,
in libpq's pipeline mode); the answer is read before the session's next
statement, which goes out right behind it when it has not arrived. One
re-entrant lock per session (its guard) serialises the handles, the library's
statements and the monitor.
"""

from __future__ import annotations

import _socket
import contextlib
import os
import threading
import time
from collections.abc import Callable, Generator, Sequence
from typing import Any

import psycopg
from psycopg import errors, generators, pq

from .handles import HandleConnection, Revoked, dead_pgconn

#: How much of what the server sent unasked is looked at (a notice or two, an error).
_PEEK_BYTES = 8192
#: The protocol's ErrorResponse: unasked, it is the server ending the session.
_ERROR_MESSAGE = b"E"
#: What an unlock's reader is told when its answer was never read.
_UNREAD = psycopg.OperationalError("the answer to the unlock was never read (interrupted)")
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
        # Never prepared: holders' handles name their prepared statements the same
        # way, and DISCARD ALL drops them all.
        conn.prepare_threshold = None
        self.pgconn = conn.pgconn
        #: Serialises every statement on the session, whoever sends it.
        self.guard = threading.RLock()
        conn.lock = self.guard  # type: ignore[assignment]
        self.dsn = dsn
        #: The process that opened the session: no other may use or close it.
        self.pid = os.getpid()
        #: The server's pid of the backend (behind a pooler, not libpq's).
        self.backend_pid = backend_pid
        #: Behind a session-mode pooler: never reused (see connection.verify_session).
        self.pooled = pooled
        #: This session's own value of pglock.session: proof a statement ran on it.
        self.token = token
        self._handles: list[psycopg.Connection[Any]] = []
        # The library's statements: run once, then prepared under their own names.
        self._used: set[bytes] = set()
        self._prepared: set[bytes] = set()
        #: Whether a holder got a handle since the session was last reset.
        self.handed_out = False
        #: Strategy ``shared``: the holds on this session, by key.
        self.holds: dict[int, Any] = {}
        self.shared = False
        #: A shared session found failed (its holds are marked lost once).
        self.failed = False
        #: Called once the session is found failed (shared: every lock on it is lost).
        self.on_failure: Callable[[str], None] | None = None
        # What reads the result of a statement sent without waiting (see send()).
        self._pending: Callable[[pq.abc.PGresult | psycopg.Error], bool] | None = None
        self.pending_since = 0.0

    def __repr__(self) -> str:
        return f"<LockSession backend {self.backend_pid} of process {self.pid}>"

    @property
    def closed(self) -> bool:
        return self.pgconn.status == pq.ConnStatus.BAD

    def handle(self) -> psycopg.Connection[Any]:
        """Return a connection for the holder: pristine client state, dies at revoke."""
        handle = HandleConnection(self.pgconn)
        handle.session = self
        handle.lock = self.guard  # type: ignore[assignment]
        handle.autocommit = True
        self._handles.append(handle)
        self.handed_out = True
        return handle

    def revoke(self, message: str) -> None:
        """Make every handle given out so far fail on its next statement."""
        for handle in list(self._handles):
            self.revoke_one(handle, message)
        # Notices of later holders must not reach a revoked handle's handlers.
        self.pgconn.notice_handler = None
        self.pgconn.notify_handler = None

    def revoke_one(self, handle: psycopg.Connection[Any], message: str) -> None:
        handle.lock = Revoked(message)  # type: ignore[assignment]
        handle.pgconn = dead_pgconn()
        with contextlib.suppress(ValueError):
            self._handles.remove(handle)

    def alive(self) -> bool:
        """Whether the server still has the session, read from the socket without a statement.

        Safe in any state between statements (idle, inside the body's
        transaction): it only peeks, so libpq and the body's transaction see
        exactly what they would have seen. A server that ended the session
        sent an error and closed the socket; a cut-off peer fails the client
        keepalives, which errors the socket.
        """
        if self.closed:
            return False
        try:
            # The C socket: gevent's and eventlet's would wait for data instead.
            sock = _socket.socket(fileno=self.pgconn.socket)
        except (psycopg.Error, OSError):
            return False
        try:
            pending = sock.recv(_PEEK_BYTES, _socket.MSG_PEEK | _socket.MSG_DONTWAIT)
        except BlockingIOError:
            return True  # nothing arrived: the usual case
        except OSError:
            return False  # reset, or keepalives found the peer gone
        finally:
            sock.detach()
        if not pending:
            return False  # the server closed the connection
        if self.pgconn.ssl_in_use:
            # Unasked data between statements is the server's goodbye in practice
            # (notifications wait for the end of a transaction); encrypted, it
            # cannot be read without consuming it.
            return self.pgconn.transaction_status == pq.TransactionStatus.IDLE
        return _ERROR_MESSAGE not in _message_types(pending)

    def query(
        self, name: bytes, sql: bytes, params: Sequence[bytes | None] = ()
    ) -> pq.abc.PGresult:
        """Run one of the library's statements; return its result or raise psycopg.Error.

        Straight at the libpq level, waiting as psycopg does (cooperatively
        under gevent and eventlet). A statement is prepared as ``name`` the
        second time the session runs it. A holder may have dropped it
        (DEALLOCATE): then it runs unprepared and is prepared again later.
        The result of a statement sent without waiting (:meth:`send`) is read
        first; when it has not arrived yet, this statement goes out behind it.
        """
        pgconn = self.pgconn
        with self.guard:
            if self._pending is not None:
                if name in self._prepared and not self._arrived():
                    result = self._settle(lambda: pgconn.send_query_prepared(name, params))
                    if result.error_field(pq.DiagnosticField.SQLSTATE) != _NO_SUCH_STATEMENT:
                        return self._checked(result)
                    self._prepared.discard(name)
                else:
                    self._settle(None)
            if name in self._prepared:
                result = self._run(lambda: pgconn.send_query_prepared(name, params))
                if result.error_field(pq.DiagnosticField.SQLSTATE) != _NO_SUCH_STATEMENT:
                    return self._checked(result)
                self._prepared.discard(name)
            elif name in self._used:
                prepared = self._run(lambda: pgconn.send_prepare(name, sql))
                if prepared.status == pq.ExecStatus.COMMAND_OK:
                    self._prepared.add(name)
                    return self._checked(
                        self._run(lambda: pgconn.send_query_prepared(name, params))
                    )
            self._used.add(name)
            return self._checked(self._run(lambda: pgconn.send_query_params(sql, params)))

    def send(
        self,
        name: bytes,
        params: Sequence[bytes | None],
        on_result: Callable[[pq.abc.PGresult | psycopg.Error], bool],
    ) -> bool:
        """Send a prepared statement of the library and return without its result.

        The result is read before the session's next statement, or by
        :meth:`settle`, and handed to ``on_result``, which says whether the
        session is still fit for use (if not, that next statement fails with
        the session's error). False, with nothing sent, when the statement is
        not prepared on this session yet or a result is already awaited.
        """
        pgconn = self.pgconn
        with self.guard:
            if name not in self._prepared or self._pending is not None:
                return False
            try:
                pgconn.enter_pipeline_mode()
                pgconn.send_query_prepared(name, params)
                pgconn.pipeline_sync()
                if pgconn.flush():
                    self._wait(generators.send(pgconn))
            except psycopg.Error:
                self.conn.close()  # half sent: not used again
                raise
            self._pending = on_result
            self.pending_since = time.monotonic()
            return True

    @property
    def pending(self) -> bool:
        """Whether a statement's result is awaited (see :meth:`send`)."""
        return self._pending is not None

    def settle(self) -> None:
        """Read the awaited result (see :meth:`send`), if any; psycopg.Error if unfit."""
        with self.guard:
            if self._pending is not None:
                self._settle(None)

    def _arrived(self) -> bool:
        """Whether the awaited result is all here (read without waiting)."""
        with contextlib.suppress(psycopg.Error):
            self.pgconn.consume_input()
        return not self.pgconn.is_busy()

    def _settle(self, send_next: Callable[[], None] | None) -> pq.abc.PGresult:
        """Read the awaited result, with ``send_next``'s sent behind it: return the latter's.

        The session reads as pending until the answer is in (another thread waiting
        for this process's unlocks waits for the guard, then finds it read).
        """
        on_result = self._pending
        assert on_result is not None
        try:
            return self._read_pending(on_result, send_next)
        finally:
            self._pending = None

    def _read_pending(
        self,
        on_result: Callable[[pq.abc.PGresult | psycopg.Error], bool],
        send_next: Callable[[], None] | None,
    ) -> pq.abc.PGresult:
        pgconn = self.pgconn
        results: list[pq.abc.PGresult] = []
        try:
            if send_next is None:
                syncs = _read_arrived(pgconn, results, 1)
            else:
                send_next()
                pgconn.pipeline_sync()
                syncs = 2
            if syncs:
                self._wait(_until_syncs(pgconn, syncs, results))
            pgconn.exit_pipeline_mode()
        except psycopg.Error as exc:
            on_result(results[0] if results else exc)  # the session may have died after it
            self.conn.close()
            raise
        except BaseException:
            # Interrupted (the session is closed by now, see _wait): what the unlock
            # answered is reported if it came, else that it cannot be known.
            on_result(results[0] if results else _UNREAD)
            raise
        if not on_result(results[0]):
            self.conn.close()
            raise psycopg.OperationalError(
                "the lock session's last unlock did not go as expected: it is not used again"
            )
        return results[2] if send_next is not None else results[0]

    def forget_prepared(self) -> None:
        """After DISCARD ALL: the server dropped every prepared statement."""
        self._prepared.clear()
        self._used.clear()

    def _run(self, send: Callable[[], None]) -> pq.abc.PGresult:
        send()
        results: list[pq.abc.PGresult] = self._wait(generators.execute(self.pgconn))
        return results[-1]

    def _wait(self, gen: Generator[Any, Any, Any]) -> Any:
        try:
            return self.conn.wait(gen)
        except psycopg.Error:
            raise
        except BaseException:
            # Interrupted (a time limit, gevent.Timeout) with a result nobody will
            # read, and a lock it may or may not have taken: the session cannot be
            # trusted again. Closed, it holds nothing; its holders are told.
            self.fail("a statement of the library was interrupted")
            raise

    def fail(self, reason: str) -> None:
        """Close a session that cannot be trusted, and tell whoever relies on it."""
        if self.pid == os.getpid():
            self.conn.close()
        if self.on_failure is not None:
            self.on_failure(f"the lock session failed: {reason}")

    def _checked(self, result: pq.abc.PGresult) -> pq.abc.PGresult:
        if result.status != pq.ExecStatus.TUPLES_OK:
            raise errors.error_from_result(result, encoding=self.conn.info.encoding)
        return result

    def close(self) -> None:
        """Close the session (its locks go with it); only in the process that opened it.

        An awaited result is read first, so that what it tells is not lost.
        """
        if self.pid == os.getpid():
            if self._pending is not None and not self.closed:
                with self.guard, contextlib.suppress(psycopg.Error):
                    self.settle()
            self.conn.close()


def _read_arrived(pgconn: pq.abc.PGconn, results: list[pq.abc.PGresult], syncs: int) -> int:
    """Read into ``results`` what already arrived of a pipeline; return the syncs still due."""
    ends = 0
    while syncs and not pgconn.is_busy():
        result = pgconn.get_result()
        if result is None:  # the end of one statement's results
            ends += 1
            if ends > 1:
                break  # nothing more is on its way
            continue
        ends = 0
        results.append(result)
        if result.status == pq.ExecStatus.PIPELINE_SYNC:
            syncs -= 1
    return syncs


def _until_syncs(
    pgconn: pq.abc.PGconn, syncs: int, results: list[pq.abc.PGresult]
) -> Generator[Any, Any, None]:
    """Flush, then read a pipeline's results into ``results`` up to its ``syncs``-th sync."""
    yield from generators.send(pgconn)
    while syncs:
        batch: list[pq.abc.PGresult] = yield from generators.fetch_many(pgconn)
        results += batch
        if not batch or batch[-1].status == pq.ExecStatus.PIPELINE_SYNC:
            syncs -= 1


def _message_types(data: bytes) -> list[bytes]:
    """The type bytes of the protocol messages that start ``data`` (type, int32 length)."""
    types, at = [], 0
    while at + 5 <= len(data):
        types.append(data[at : at + 1])
        at += 1 + int.from_bytes(data[at + 1 : at + 5], "big")
    return types
