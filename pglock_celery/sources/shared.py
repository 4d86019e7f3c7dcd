"""Strategy ``shared``: every lock of a process on a few sessions per configuration.

Thread and gevent pools of hundreds would otherwise hold a Postgres backend per
running call. Here a lock is taken on one of at most ``pglock_shared_sessions``
sessions. Session locks are re-entrant, so a name is first claimed in this
source: a second holder here finds it claimed and skips, as if another worker
held it. The session records its keys in ``pglock.held`` for guarded tables.

Only a session that failed (closed, ended by the server, a statement of the
library interrupted) takes every lock on it: all its holds are marked lost at
once. An SQL error of one holder's statement on a live session is that holder's
alone.

Holders get no connection of their own: ``lock.transaction()`` gives one, with
the session to itself for that transaction (other holders on it wait), and
resets what the transaction left on the session afterwards.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import psycopg

from .. import sql
from ..config import PglockConfig
from ..exceptions import LockLost, LockTimeout, LockUnavailable, PglockError
from ..monitor import Hold, one_line
from ..session import LockSession, application_name, apply_settings, open_session
from .base import LeaderProblem, Registry, Source, fenced_transaction

#: Longest pause between two tries of a waiting shared lock, in seconds.
MAX_POLL = 0.5


class SharedSource(Source):
    """At most ``shared_sessions`` sessions, shared by every lock of this configuration."""

    def __init__(self, config: PglockConfig, registry: Registry) -> None:
        super().__init__(config, registry)
        self._ready = threading.Condition(self._mutex)
        self._pool: list[LockSession] = []
        self._opening = 0
        #: The holds on each session, by key.
        self._holds: dict[LockSession, dict[int, Hold]] = {}
        #: Keys claimed by a holder of this source (see the module docstring).
        self._claimed: set[int] = set()
        self._name = application_name(f"{config.application_name}-shared", "", None)

    # -- acquire ---------------------------------------------------------------------

    def acquire(self, hold: Hold, *, wait: bool, timeout: float | None) -> bool:
        """Claim the key here, then try it on the least busy session.

        Waiting polls (the session serves other holders meanwhile) with a growing
        pause, up to ``timeout``; LockTimeout after it.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        pause = 0.01
        while True:
            if self._claim(hold.key):
                try:
                    hold.session = session = self._session()
                    if self._try(session, hold):
                        with self._mutex:
                            self._holds[session][hold.key] = hold
                        hold.granted = True
                        return True
                except BaseException:
                    self._unclaim(hold.key)
                    raise
                self._unclaim(hold.key)
            if not wait:
                return False
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise LockTimeout(f"lock {hold.label} not obtained within {timeout:g} s")
            time.sleep(pause if left is None else min(pause, left))
            pause = min(pause * 2, MAX_POLL)

    def _claim(self, key: int) -> bool:
        with self._mutex:
            if key in self._claimed:
                return False
            self._claimed.add(key)
            return True

    def _unclaim(self, key: int) -> None:
        with self._mutex:
            self._claimed.discard(key)

    def _session(self) -> LockSession:
        """The least busy live session, opening one while below the bound.

        A caller that finds none ready waits for one being opened by another.
        An idle session the server ended (a restart, a DBA) held nothing: it is
        closed and another taken.
        """
        while True:
            session: LockSession | None = None
            with self._ready:
                while True:
                    for closed in [s for s in self._pool if s.closed and not self._holds[s]]:
                        self._holds.pop(closed)  # a closed one with holds is failed by a check
                    self._pool[:] = [s for s in self._pool if not s.closed]
                    quiet = [s for s in self._pool if not self._holds[s]]
                    if self._pool and (
                        quiet or len(self._pool) + self._opening >= self.config.shared_sessions
                    ):
                        session = min(quiet or self._pool, key=lambda s: len(self._holds[s]))
                        break
                    if len(self._pool) + self._opening < self.config.shared_sessions:
                        self._opening += 1
                        break
                    self._ready.wait()
            if session is None:
                return self._open()
            if self._holds.get(session) or session.alive():
                return session
            self._fail(session, "the idle lock session was ended by the server")

    def _open(self) -> LockSession:
        try:
            with self.registry.opening():
                session = open_session(self.config, self._name)
                self._register(session)
        except BaseException:
            with self._ready:
                self._opening -= 1
                self._ready.notify_all()
            raise
        with self._ready:  # one step: the bound is never passed, not even for a moment
            self._opening -= 1
            self._holds[session] = {}
            self._pool.append(session)
            self._ready.notify_all()
        return session

    def _try(self, session: LockSession, hold: Hold) -> bool:
        key = str(hold.key).encode()
        try:
            result = session.query(*sql.TRY_SHARED, (session.token.encode(), key))
        except psycopg.Error as exc:
            if session.closed or not session.alive():
                self._fail(session, f"the lock session failed: {one_line(exc)}")
            raise LockUnavailable(
                f"lock {hold.label}: the shared lock session refused the lock statement: "
                f"{one_line(exc)}"
            ) from exc
        except BaseException:
            # Interrupted (a time limit): the try may have taken the key. Nobody else
            # here holds it (it is claimed), so it is let go whatever happened.
            self._let_go(session, key)
            raise
        got, backend_pid = result.get_value(0, 0), result.get_value(0, 1)
        if got is None or backend_pid is None or int(backend_pid) != session.backend_pid:
            self._fail(session, "the lock session is not on its own backend")
            raise LockUnavailable(
                f"lock {hold.label}: the shared lock session did not run on its own backend: "
                "a pooler moved it, so it fails closed"
            )
        return got == b"t"

    # -- release ---------------------------------------------------------------------

    def release(self, hold: Hold, *, clean: bool) -> None:
        session = hold.session
        if session is None or not hold.granted:
            return
        label = hold.label
        try:
            with session.guard:
                if hold.handle is not None:
                    # Released inside its own transaction: that transaction must not
                    # commit once the lock is free.
                    session.revoke(f"lock {label} was released: this connection is closed")
                    hold.handle = None
                    session.conn.rollback()
                key = str(hold.key).encode()
                try:
                    unlocked = session.query(*sql.UNLOCK_SHARED, (key,)).get_value(0, 0)
                except psycopg.Error:
                    raise
                except BaseException:
                    self._let_go(session, key)  # interrupted: the key must not stay held
                    raise
        except psycopg.Error as exc:
            if session.closed or not session.alive():
                self._fail(session, f"the lock session failed: {one_line(exc)}")
            else:
                self._let_go(session, str(hold.key).encode())
            self.monitor.count_loss("at_release")
            raise LockLost(
                f"lock {label}: the shared session failed at release, so the lock was lost "
                f"before it: {one_line(exc)}"
            ) from exc
        finally:
            with self._ready:
                self._holds.get(session, {}).pop(hold.key, None)
                self._claimed.discard(hold.key)
                self._ready.notify_all()
        if unlocked != b"t":
            self.monitor.count_loss("at_release")
            raise LockLost(f"lock {label} was no longer held at release")
        if hold.lost is not None:
            raise LockLost(f"lock {label} was lost while held: {hold.lost}")

    # -- what a holder touches ---------------------------------------------------------

    def connection(self, hold: Hold) -> psycopg.Connection[Any]:
        raise PglockError(
            f"lock {hold.label} is on a shared session, which has no connection of "
            "its own: write through `with lock.transaction() as conn:`"
        )

    @contextlib.contextmanager
    def transaction(self, hold: Hold) -> Iterator[psycopg.Connection[Any]]:
        """A connection in a transaction on the hold's session, which it has to itself.

        Nested, it is a savepoint of the same transaction, as psycopg's own.
        """
        session = hold.session
        assert session is not None
        with session.guard:
            if hold.handle is not None:
                with hold.handle.transaction():
                    yield hold.handle
                return
            reason = self.check(hold, wait=True)
            if reason is not None:
                hold.mark_lost(reason)
                raise LockLost(f"lock {hold.label} was lost: {reason}")
            hold.handle = handle = session.handle()
            with self._mutex:
                keys = list(self._holds.get(session, {}))
            try:
                with fenced_transaction(
                    session, handle, keys, hold.key, lambda: self.before_commit(hold)
                ):
                    yield handle
            finally:
                hold.handle = None
                session.revoke(
                    f"the transaction of lock {hold.label} ended: this connection is closed"
                )
                self._reset(session)

    def _reset(self, session: LockSession) -> None:
        """Take back from the session what a holder's transaction left; the locks stay."""
        if session.closed:
            return
        with self._mutex:
            held = "," + "".join(f"{key}," for key in self._holds.get(session, {}))
        try:
            session.execute(sql.RESET_AFTER_TRANSACTION.format(held=held).encode())
            session.forget_prepared()
            if session.pooled:  # its settings came from set_config, which RESET ALL undid
                apply_settings(session.conn, self.config, session.token)
        except psycopg.Error as exc:
            self._fail(session, f"the lock session failed: {one_line(exc)}")

    def _let_go(self, session: LockSession, key: bytes) -> None:
        """Make sure the session no longer holds ``key`` (after an interrupted statement).

        A session that cannot be asked fails: closed, it holds nothing.
        """
        if session.closed:
            self._fail(session, "the lock session failed: a statement was interrupted")
            return
        try:
            session.query(*sql.UNLOCK_SHARED, (key,))
        except BaseException:
            self._fail(session, "the lock session failed: a statement was interrupted")

    # -- losses ------------------------------------------------------------------------

    def cut_off(self, hold: Hold, reason: str) -> None:
        """Cut the session only when every lock on it is lost: its server does not lead.

        One lock's loss leaves the others' locks on the session alone (a cut would
        end them too).
        """
        if isinstance(reason, LeaderProblem):
            self._cut_if_busy(hold.session)

    def lost(self, hold: Hold, reason: str) -> None:
        if hold.session is not None and "session failed" in reason:
            self._fail(hold.session, reason)

    def _fail(self, session: LockSession, reason: str) -> None:
        """A shared session failed: every lock on it is lost (once), and it leaves the pool."""
        with self._ready:
            holds = list(self._holds.pop(session, {}).values())
            if session in self._pool:
                self._pool.remove(session)
            self._ready.notify_all()
        self._discard(session)
        for hold in holds:
            hold.mark_lost(reason)

    def close(self) -> None:
        with self._mutex:
            quiet = [s for s in self._pool if not self._holds.get(s)]
            self._pool[:] = [s for s in self._pool if self._holds.get(s)]
            for session in quiet:
                self._holds.pop(session, None)
        for session in quiet:
            self._discard(session)

    def session_count(self) -> int:
        """Shared sessions open (for tests and benchmarks)."""
        with self._mutex:
            return len(self._pool)

    def after_fork_in_child(self) -> list[LockSession]:
        inherited = super().after_fork_in_child()
        self._ready = threading.Condition(self._mutex)
        self._pool, self._opening, self._holds = [], 0, {}
        self._claimed = set()
        return inherited
