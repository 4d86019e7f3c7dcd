"""Strategy ``shared``: every lock of a process on a few sessions per DSN.

Thread and gevent pools of hundreds would otherwise hold a Postgres backend
per running call. Here a lock is taken on one of at most
``pglock_shared_sessions`` sessions (sessions.shared_session). Session locks
are re-entrant, so a name is first claimed in this process (sessions.claim):
a second holder here finds it claimed and skips, as if another worker held it.
A held lock is taken twice, like every lock (see lock.py), and the session
records its keys in pglock.held for guarded tables. A failed shared session
takes every lock on it: all its holds are marked lost at once.

Holders get no connection of their own: ``lock.transaction()`` gives one, with
the session to itself for that transaction (other holders on it wait), and
resets what the transaction left on the session afterwards.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import psycopg

from . import sessions
from .config import PglockConfig
from .connection import application_name, apply_settings
from .exceptions import LockLost, LockTimeout, LockUnavailable
from .lock_session import LockSession
from .monitor import Hold, one_line

# Taken only on the session's own backend; a second time once granted; the key is
# added to the session's pglock.held (",k1,k2,").
_TRY = (
    b"pglock_try_shared",
    b"SELECT got, pg_backend_pid(), CASE WHEN got THEN"
    b" set_config('pglock.held',"
    b" coalesce(nullif(current_setting('pglock.held', true), ''), ',') || $2 || ',', false)"
    b" || pg_try_advisory_lock($2::int8)::text END"
    b" FROM (SELECT CASE WHEN current_setting('pglock.session', true) = $1"
    b" THEN pg_try_advisory_lock($2::int8) END AS got) AS attempt",
)
# Both counts go; the first result says whether it was still held.
_UNLOCK = (
    b"pglock_unlock_shared",
    b"SELECT pg_advisory_unlock($1::int8), pg_advisory_unlock($1::int8),"
    b" set_config('pglock.held',"
    b" replace(current_setting('pglock.held', true), ',' || $1 || ',', ','), false)",
)
# After a holder's transaction: its session-level state goes, the locks stay.
_RESET = (
    "SET SESSION AUTHORIZATION DEFAULT; RESET ALL; DEALLOCATE ALL; CLOSE ALL; UNLISTEN *;"
    " DISCARD TEMP; DISCARD SEQUENCES; SELECT set_config('pglock.held', '{held}', false)"
)
#: Longest pause between two tries of a waiting shared lock, in seconds.
MAX_POLL = 0.5


def shared_name(prefix: str) -> str:
    """The application_name of a shared session: its process and host, no lock name.

    It holds many locks, so it names none; ``locks`` still shows its pid and host.
    """
    return application_name(f"{prefix}-shared", "", None)


def acquire(
    config: PglockConfig,
    key: int,
    label: str,
    *,
    wait: bool,
    timeout: float | None,
    open_one: Callable[[], LockSession],
    make_hold: Callable[[LockSession], Hold],
) -> tuple[LockSession | None, Hold | None]:
    """Take ``key`` on a shared session: ``(session, hold)``, hold None when not taken.

    Waiting polls (the session serves other holders meanwhile) with a growing
    pause, up to ``timeout``; LockTimeout after it.
    """
    dsn = config.require_dsn()
    deadline = None if timeout is None else time.monotonic() + timeout
    pause = 0.01
    while True:
        session = None
        if sessions.claim(dsn, key):
            try:
                session = sessions.shared_session(config, open_one)
                if not session.holds and not session.alive():
                    # Idle and dead (a restart, a DBA): it held nothing; take another.
                    fail(session, "the idle lock session was ended by the server")
                    session = sessions.shared_session(config, open_one)
                if _try(session, key, label):
                    hold = make_hold(session)
                    with sessions.locked():
                        session.holds[key] = hold
                    return session, hold
            except BaseException:
                sessions.unclaim(dsn, key)
                raise
            sessions.unclaim(dsn, key)
        if not wait:
            return session, None
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            raise LockTimeout(f"lock {label} not obtained within {timeout:g} s")
        time.sleep(pause if left is None else min(pause, left))
        pause = min(pause * 2, MAX_POLL)


def _try(session: LockSession, key: int, label: str) -> bool:
    encoded = str(key).encode()
    try:
        result = session.query(*_TRY, (session.token.encode(), encoded))
    except psycopg.Error as exc:
        fail(session, f"the lock session failed: {one_line(exc)}")
        raise LockUnavailable(
            f"lock {label}: the shared lock session failed while locking: {one_line(exc)}"
        ) from exc
    got, backend_pid = result.get_value(0, 0), result.get_value(0, 1)
    if got is None or backend_pid is None or int(backend_pid) != session.backend_pid:
        fail(session, "the lock session is not on its own backend")
        raise LockUnavailable(
            f"lock {label}: the shared lock session did not run on its own backend: "
            "a pooler moved it, so it fails closed"
        )
    return got == b"t"


def release(session: LockSession, hold: Hold, label: str) -> None:
    """Unlock ``hold`` on its shared session; raise LockLost if it was gone."""
    dsn, key = session.dsn, hold.key
    try:
        with session.guard:
            if hold.handle is not None:
                # Released inside its own transaction: that transaction must not
                # commit once the lock is free.
                session.revoke(f"lock {label} was released: this connection is closed")
                hold.handle = None
                session.conn.rollback()
            unlocked = session.query(*_UNLOCK, (str(key).encode(),)).get_value(0, 0)
    except psycopg.Error as exc:
        fail(session, f"the lock session failed: {one_line(exc)}")
        raise LockLost(
            f"lock {label}: the shared session failed at release, so the lock was lost "
            f"before it: {one_line(exc)}"
        ) from exc
    finally:
        with sessions.locked():
            session.holds.pop(key, None)
        sessions.unclaim(dsn, key)
    if unlocked != b"t":
        raise LockLost(f"lock {label} was no longer held at release")
    if hold.lost is not None:
        raise LockLost(f"lock {label} was lost while held: {hold.lost}")


def fail(session: LockSession, reason: str) -> None:
    """A shared session failed: every lock on it is lost, and it leaves the pool. Once."""
    with sessions.locked():
        if session.failed:
            return
        session.failed = True
        holds = list(session.holds.values())
    sessions.drop_shared(session)
    for hold in holds:
        hold.mark_lost(reason)


@contextlib.contextmanager
def transaction(hold: Hold, label: str) -> Iterator[psycopg.Connection[Any]]:
    """A connection in a transaction on ``hold``'s shared session, which it has to itself.

    Nested, it is a savepoint of the same transaction, as psycopg's own.
    """
    session = hold.session
    with session.guard:
        if hold.handle is not None:
            with hold.handle.transaction():
                yield hold.handle
            return
        reason = hold.check(wait=True)
        if reason is not None:
            hold.mark_lost(reason)
            raise LockLost(f"lock {label} was lost: {reason}")
        hold.handle = session.handle()
        try:
            with hold.handle.transaction():
                yield hold.handle
        finally:
            hold.handle = None
            session.revoke(f"the transaction of lock {label} ended: this connection is closed")
            _reset(session, hold)


def _reset(session: LockSession, hold: Hold) -> None:
    """Take back from the session what a holder's transaction left; the locks stay."""
    if session.closed:
        return
    with sessions.locked():
        held = "," + "".join(f"{key}," for key in session.holds)
    try:
        session.conn.execute(_RESET.format(held=held))
        session.forget_prepared()
        if session.pooled:  # its settings came from set_config, which RESET ALL undid
            apply_settings(session.conn, hold.config, session.token)
    except psycopg.Error as exc:
        fail(session, f"the lock session failed: {one_line(exc)}")
