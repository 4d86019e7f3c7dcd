"""Strategy ``shared``: every lock of a process on a few sessions per configuration.

Thread and gevent pools of hundreds would otherwise hold a Postgres backend per
running call. Here a lock is taken on one of at most ``pglock_shared_sessions``
sessions. Session locks are re-entrant, so a name is first claimed in this
source: a second holder here finds it claimed and skips, as if another worker
held it. The session records its keys in ``pglock.held`` for guarded tables.

Only a loss that takes the session (it ended, its server may not lead, nobody
can tell) takes every lock on it: all its holds are marked lost at once, and the
session is cut. An SQL error of one holder's try on a live session is that
holder's alone.

**A session that carries other holders' locks never runs a holder's SQL.**
Holders get neither a connection nor a transaction: ``lock.connection`` and
``lock.transaction()`` refuse with a PglockError naming the strategies that give
fenced writes (``reuse``, ``connect``). Any SQL of a holder's on a shared session
could free its neighbours' locks (``pg_advisory_unlock_all()``, directly or inside
a function, survives a rollback), and no check of statements can prevent that;
so the only SQL a shared session ever runs is the library's own.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from typing import Any

import psycopg

from .. import sql
from ..config import PglockConfig
from ..exceptions import LockLost, LockTimeout, LockUnavailable, PglockError
from ..loss import Loss, lock_gone, session_ended
from ..monitor import Hold, one_line
from ..session import LockSession, application_name
from .base import Registry, Source

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
            if not self._holds.get(session) and not session.alive():
                self._fail(session, session_ended("the idle lock session was ended by the server"))
                continue
            loss = self.leader_problem(session)  # fence first: no try on an unconfirmed server
            if loss is None:
                return session
            self._fail(session, loss)

    def _open(self) -> LockSession:
        try:
            with self.registry.opening(self.config):
                session = self.open_on_leader(self._name)
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
                self._fail(session, session_ended(f"the lock session failed: {one_line(exc)}"))
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
            self._fail(session, session_ended("the lock session is not on its own backend"))
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
        unlocked: bytes | None = b"t"
        try:
            if hold.lost is not None:
                if not hold.lost.takes_the_session:
                    self._let_go(session, str(hold.key).encode())  # the key, if any count stayed
                raise LockLost(f"lock {label} was lost while held: {hold.lost}")
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
                self._fail(session, session_ended(f"the lock session failed: {one_line(exc)}"))
            else:
                self._let_go(session, str(hold.key).encode())
            self.monitor.found_at_release(
                hold, session_ended(f"the lock session failed at release: {one_line(exc)}")
            )
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
            self.monitor.found_at_release(
                hold, lock_gone("the session no longer held the lock at release")
            )
            raise LockLost(f"lock {label} was no longer held at release")

    # -- what a holder touches ---------------------------------------------------------

    def connection(self, hold: Hold) -> psycopg.Connection[Any]:
        raise _no_sql_here(hold, "lock.connection")

    def transaction(
        self, hold: Hold, also_held: Callable[[], None] | None = None
    ) -> contextlib.AbstractContextManager[psycopg.Connection[Any]]:
        raise _no_sql_here(hold, "lock.transaction()")

    def _let_go(self, session: LockSession, key: bytes) -> None:
        """Make sure the session no longer holds ``key`` (after an interrupted statement).

        A session that cannot be asked fails: closed, it holds nothing.
        """
        interrupted = session_ended("the lock session failed: a statement was interrupted")
        if session.closed:
            self._fail(session, interrupted)
            return
        try:
            session.query(*sql.UNLOCK_SHARED, (key,))
        except BaseException:
            self._fail(session, interrupted)

    # -- losses ------------------------------------------------------------------------

    def end_use(self, hold: Hold, loss: Loss) -> None:
        """A loss that takes the session fails it (every lock on it, and it is cut).

        One lock gone from a live session leaves the others' locks on it alone (a
        cut would end them too); its holder runs no SQL on the session to stop.
        """
        session = hold.session
        if session is not None and loss.takes_the_session:
            session.cut()
            self._fail(session, loss)

    def _fail(self, session: LockSession, loss: Loss) -> None:
        """A shared session failed: every lock on it is lost (once), and it leaves the pool.

        Closed when no statement is under way on it, else by the statement under way
        as it ends (it fails at once: the session is cut).
        """
        with self._ready:
            holds = list(self._holds.pop(session, {}).values())
            if session in self._pool:
                self._pool.remove(session)
            self._ready.notify_all()
        session.cut()
        session.retire()  # closed now, or by the statement under way as it ends
        with self._mutex:
            self._sessions.discard(session)
        for hold in holds:
            hold.mark_lost(loss)

    def close(self) -> None:
        with self._mutex:
            quiet = [s for s in self._pool if not self._holds.get(s)]
            self._pool[:] = [s for s in self._pool if self._holds.get(s)]
            for session in quiet:
                self._holds.pop(session, None)
        for session in quiet:
            self._discard(session)
        self.close_probes()

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


def _no_sql_here(hold: Hold, what: str) -> PglockError:
    return PglockError(
        f"lock {hold.label} is on a shared lock session, which carries other holders' "
        f"locks and never runs a holder's SQL, so {what} is not given under "
        'pglock_strategy = "shared": for writes fenced by the lock, use pglock_strategy '
        '= "reuse" (the default) or "connect" for this task\'s app'
    )
