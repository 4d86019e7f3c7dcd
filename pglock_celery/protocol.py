"""The lock protocol: the statements that take, prove and free a lock on a dedicated session.

Statements are bytes for libpq, prepared per session under their own names (see
LockSession.query). Every lock statement proves that it ran on the session's
own backend (its ``pglock.session`` token in force, no earlier holder's key in
``pglock.held``), so a session moved by a pooler fails closed instead of
locking elsewhere. A held lock is taken twice (its count is 2), so that the
monitor can unlock it once and take it again without letting it go: "still
held" in O(1), never from pg_locks (monitor.py).

Under strategy ``reuse`` the unlock of a session going back to the cache is
sent without waiting for its result: it is read before the session's next
statement (behind which the next lock goes out when it has not arrived yet),
or by the monitor scheduler within a tick. A lock found lost then is reported
after the release returned (see Hold.lost_at_release). A try that finds a name
held, and a wait before it starts, first wait for this process's unread unlocks
(sessions.settle_pending): a lock released here is free for the next lock here.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import psycopg
from psycopg import errors as pg_errors
from psycopg import pq
from psycopg.pq import TransactionStatus

from . import sessions
from .config import PglockConfig
from .connection import idle_name, open_session
from .exceptions import LockLost, LockTimeout, LockUnavailable
from .lock_session import LockSession
from .monitor import Hold, one_line
from .scheduler import scheduler

#: The session setting where a lock session records the keys it holds, as
#: ``,key,``; guarded tables read it instead of pg_locks (see guard.py).
HELD_SETTING = "pglock.held"

# Tries the lock only on the session's own backend (its token in force) holding
# nothing of an earlier holder's (NULL otherwise: a pooler moved it); if it got it,
# takes it a second time, names the session after its holder and records the key.
_TRY = (
    b"pglock_try",
    b"SELECT got, pg_backend_pid(), CASE WHEN got THEN"
    b" set_config('application_name', $1, false) || set_config('pglock.held', $2, false)"
    b" || pg_try_advisory_lock($4::int8)::text END"
    b" FROM (SELECT CASE WHEN current_setting('pglock.session', true) = $3"
    b" AND coalesce(current_setting('pglock.held', true), '') = ''"
    b" THEN pg_try_advisory_lock($4::int8) END AS got) AS attempt",
)
# The same proof before waiting: '' once granted, NULL when not on its own backend.
_WAIT = (
    b"pglock_wait",
    b"SELECT CASE WHEN current_setting('pglock.session', true) = $1"
    b" AND coalesce(current_setting('pglock.held', true), '') = ''"
    b" THEN pg_advisory_lock($2::int8)::text END",
)
_SET_TIMEOUT = (
    b"pglock_set_timeout",
    b"SELECT current_setting('lock_timeout'), set_config('lock_timeout', $1, false)",
)
# NULL leaves lock_timeout as it is; else the value it had before the wait.
_AFTER_WAIT = (
    b"pglock_after_wait",
    b"SELECT pg_backend_pid(), set_config('application_name', $1, false),"
    b" set_config('pglock.held', $2, false), pg_try_advisory_lock($4::int8),"
    b" set_config('lock_timeout', coalesce($3::text, current_setting('lock_timeout')), false)",
)
# Free at once (the session closes right after, but its end is not waited for).
_UNLOCK = (b"pglock_unlock", b"SELECT pg_advisory_unlock($1::int8), pg_advisory_unlock_all()")
# Back to the cache: no advisory lock of the holder's may stay, nor its name.
_UNLOCK_FOR_REUSE = (
    b"pglock_unlock_reuse",
    b"SELECT pg_advisory_unlock($1::int8), pg_advisory_unlock_all(),"
    b" set_config('application_name', $2, false), set_config('pglock.held', '', false)",
)


def acquire(
    config: PglockConfig,
    kept: LockSession | None,
    lock_on: Callable[[LockSession], bool],
    label: str,
    application_name: str,
    *,
    wait: bool,
) -> tuple[LockSession, bool]:
    """Take a lock with ``lock_on`` on a dedicated session; return it and whether granted.

    The session is the one ``kept`` from a failed try, else an idle one of this
    process (strategy ``reuse``), else a new one: under ``reuse`` named as idle
    (it outlives its holder), else ``application_name``.
    """
    reuse = config.strategy == sessions.REUSE
    if wait and reuse:
        # A wait must not wait for this process's own unlocks still unread.
        sessions.settle_pending()
    session = kept if kept is not None or not reuse else sessions.take(config)
    got = False
    if session is not None:
        try:
            got = lock_on(session)
        except psycopg.Error:
            # An idle session that died or went wrong meanwhile: it held
            # nothing, so a fresh one may take its place.
            sessions.discard(session)
            session = None
        except BaseException:
            sessions.discard(session)
            raise
    if session is None:
        startup = idle_name(config.application_name) if reuse else application_name
        session = open_session(config, startup)
        got = _lock_or_fail(session, lock_on, label)
    if not got and not wait and reuse:
        # This process's own unlocks, sent a moment ago, may not have been read
        # by the server yet: once they are, a lock it released is free.
        try:
            settled = sessions.settle_pending()
        except BaseException:
            sessions.discard(session)
            raise
        if settled:
            got = _lock_or_fail(session, lock_on, label)
    return session, got


def _lock_or_fail(session: LockSession, lock_on: Callable[[LockSession], bool], label: str) -> bool:
    """Take the lock on ``session``; closed on any error, LockUnavailable on a failed one."""
    try:
        return lock_on(session)
    except psycopg.Error as exc:
        sessions.discard(session)
        raise LockUnavailable(
            f"lock {label}: the lock session failed while locking: {one_line(exc)}"
        ) from exc
    except BaseException:
        sessions.discard(session)
        raise


def lock_on(
    session: LockSession,
    key: int,
    application_name: str,
    label: str,
    *,
    wait: bool,
    timeout: float | None,
) -> bool:
    """Take the lock on ``session`` (a fresh or a cached one); return whether granted."""
    key_text = str(key).encode()
    name = application_name.encode()
    held = b"," + key_text + b","
    if not wait:
        result = session.query(*_TRY, (name, held, session.token.encode(), key_text))
        got = result.get_value(0, 0)
        if got is None:
            raise moved(session, label, _int(result.get_value(0, 1)))
        _check_backend(session, label, _int(result.get_value(0, 1)))
        return got == b"t"
    with session.guard:
        restore = None
        if timeout is not None:
            # lock_timeout = 0 means "forever" to Postgres: wait at least 1 ms.
            millis = max(1, round(timeout * 1000))
            restore = session.query(*_SET_TIMEOUT, (b"%dms" % millis,)).get_value(0, 0)
        try:
            waited = session.query(*_WAIT, (session.token.encode(), key_text))
        except pg_errors.LockNotAvailable:
            raise LockTimeout(f"lock {label} not obtained within {timeout:g} s") from None
        if waited.get_value(0, 0) is None:
            raise moved(session, label, None)
        result = session.query(*_AFTER_WAIT, (name, held, restore, key_text))
    _check_backend(session, label, _int(result.get_value(0, 0)))
    return True


def _int(value: bytes | None) -> int | None:
    return int(value) if value is not None else None


def _check_backend(session: LockSession, label: str, backend_pid: int | None) -> None:
    if backend_pid != session.backend_pid:
        raise moved(session, label, backend_pid)


def moved(session: LockSession, label: str, backend_pid: int | None) -> LockUnavailable:
    """The error for a lock statement that did not run on the session's own backend."""
    return LockUnavailable(
        f"lock {label}: the lock statement did not run on the session's own "
        f"backend {session.backend_pid} (it ran on {backend_pid or 'another'}, without "
        "this session's token, or with an earlier holder's lock): a pooler moved the "
        "session, so it fails closed"
    )


def release(
    session: LockSession,
    hold: Hold | None,
    config: PglockConfig,
    *,
    reusable: bool,
    confirm: bool = False,
) -> None:
    """Unlock a dedicated session and let it go: back to the cache when ``reusable`` allows.

    Every handle given to the holder is revoked first; an open transaction is
    rolled back. Raises LockLost when the unlock shows the lock was already
    gone (false, or a failed session). The session goes back only after a
    clean unlock with nothing else in doubt; otherwise it is closed, which
    frees the lock anyway. Going back, its unlock is sent without waiting
    unless ``confirm``.
    """
    keep = False
    try:
        if hold is None:
            keep = reusable  # nothing was taken on this session
            return
        keep = _unlock(session, hold, config, reuse=reusable, confirm=confirm) and reusable
        if keep and session.handed_out:
            try:
                session.conn.execute("DISCARD ALL")  # the holder's server state goes
                session.forget_prepared()
            except psycopg.Error:
                keep = False
    finally:
        if not (keep and sessions.give_back(config, session)):
            sessions.discard(session)


def _unlock(
    session: LockSession, hold: Hold, config: PglockConfig, *, reuse: bool, confirm: bool
) -> bool:
    """Unlock; return whether the session may be used again, or raise LockLost."""
    label = hold.label
    session.revoke(f"lock {label} was released: this connection is closed")
    clean = True
    key = str(hold.key).encode()
    try:
        with session.guard:
            status = session.pgconn.transaction_status
            if status not in (TransactionStatus.IDLE, TransactionStatus.UNKNOWN):
                if status == TransactionStatus.ACTIVE:
                    # A statement still runs (another thread of the holder):
                    # closing the session is the only clean way out.
                    return False
                session.conn.rollback()
                clean = False
            if not reuse:
                unlocked = session.query(*_UNLOCK, (key,)).get_value(0, 0)
            else:
                params = (key, idle_name(config.application_name).encode())
                on_result = functools.partial(_confirm, hold)
                # A holder with a handle is reset with DISCARD ALL next: no gain then.
                if (
                    not confirm
                    and clean
                    and hold.lost is None
                    and not session.handed_out
                    and not session.pgconn.pipeline_status
                    and session.alive()  # the server's goodbye fails the release now
                    and session.send(_UNLOCK_FOR_REUSE[0], params, on_result)
                ):
                    return True
                unlocked = session.query(*_UNLOCK_FOR_REUSE, params).get_value(0, 0)
    except psycopg.Error as exc:
        hold.count_lost_at_release()
        raise LockLost(
            f"lock {label}: the session failed at release, so the lock "
            f"was lost before it: {one_line(exc)}"
        ) from exc
    if unlocked != b"t":
        hold.count_lost_at_release()
        raise LockLost(f"lock {label} was no longer held at release")
    if hold.lost is not None:
        raise LockLost(f"lock {label} was lost while held: {hold.lost}")
    return clean and not session.pgconn.pipeline_status


def _confirm(hold: Hold, result: pq.abc.PGresult | psycopg.Error) -> bool:
    """Read an unlock sent without waiting: report a loss; whether the session is fit."""
    if isinstance(result, psycopg.Error):
        reason = f"the session failed at release, so the lock was lost before it: {result}"
    elif result.status != pq.ExecStatus.TUPLES_OK:
        message = " ".join(result.error_message.decode(errors="replace").split())
        reason = f"the unlock at release failed: {message}"
    elif result.get_value(0, 0) != b"t":
        reason = "it was no longer held at release"
    else:
        return True
    hold.lost_at_release(" ".join(reason.split()))
    return False


# Unlocks sent without waiting are read within a tick when no next lock reads them.
scheduler.chores.append(sessions.confirm_idle)
