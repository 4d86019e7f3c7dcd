"""The fence of a change of the shards and the sessions in it (docs/shards.md "Changing
the shards", docs/limits.md 30-32): a transition's wait that keeps its previous shard's
lock, a retried acquire that keeps it too, sessions from before the record when going
back, one database under two DSNs whose sessions differ in TimeZone.

Real Postgres only: databases pglock_rollout_<random> on the test server (dropped after).
Holders are in-process AdvisoryLock objects of the old map, the transition and the new
map (distinct application_name prefixes); the operator's steps are the Rollout that
`pglock-celery shards` builds (cli._rollout, from PGLOCK_* in the environment).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from pglock_celery import LockTimeout, rollout
from pglock_celery.config import PglockConfig
from pglock_celery.keys import lock_key
from pglock_celery.lock import AdvisoryLock
from pglock_celery.rollout import Rollout, RolloutRefused
from pglock_celery.shards import parse_shards
from pglock_celery.sources import registry
from tests.support.rollout import configs, let_go, moving_name, operator, try_hold

# -- set-up -------------------------------------------------------------------------


def connect(dsn: str) -> psycopg.Connection:
    return psycopg.connect(dsn, autocommit=True)


# -- going back while a session from before the record is connected -----------------------


def test_going_back_is_refused_while_an_old_map_session_from_before_the_record_holds(
    make_dbs: Callable[[int], list[str]], clean_env: pytest.MonkeyPatch
) -> None:
    """An old-map worker holds a moving name on a session opened before any record (no
    `init`: begin creates the record where it is missing, as the docs allow). finish
    exits with it still connected (record: the transition alone). The reverse change's
    begin (pglock_shards = OLD, pglock_shards_previous = NEW) must then be refused, as it
    is for a recorded old-map session: it accepts NEW beside it."""
    a, b, c = make_dbs(3)
    old, new = {"a": a, "b": b}, {"a": a, "b": b, "c": c}
    name = moving_name(old, new)
    o, _, n = configs(old, new)
    old_holder = AdvisoryLock(name, config=o)
    newer = AdvisoryLock(name, config=n)
    both = False
    refused = None
    left = None
    try:
        assert old_holder.acquire(), "the old map could not lock before any record"
        forward = operator(clean_env, new, old)
        forward.begin()
        _, left = forward.finish(0.5, lambda _: None)
        assert left, "finish did not see the old-map holder from before the record"
        back = operator(clean_env, old, new)
        try:
            back.begin()
        except RolloutRefused as exc:
            refused = exc
        both = try_hold(newer) and old_holder.acquired
    finally:
        let_go(newer, old_holder)
        registry.close()
    assert not both, (
        "two holders of one name: finish saw the old-map session from before the record "
        f"({rollout.describe(left or {})}), yet the reverse change's begin ignored it (it "
        "counts sessions that recorded no map as allowed) and accepted the new map; a "
        f"new-map worker then locked {name!r} on its new shard while the old-map worker "
        f"held it on its old one (begin refused: {refused})"
    )


# -- one database under two DSNs whose sessions show times differently ------------------


def _one_database_two_ways(dsn: str) -> tuple[str, str]:
    """Two DSNs of one database: another text (hostaddr added) and, for the second, a
    session TimeZone of its own (as a role's or the DSN's options may give)."""
    params = conninfo_to_dict(dsn)
    host = str(params.get("host") or "127.0.0.1")
    first = make_conninfo(dsn, options="-c TimeZone=UTC")
    second = make_conninfo(
        dsn,
        hostaddr="127.0.0.1" if not host.startswith("/") else "",
        options="-c TimeZone=Asia/Tokyo",
    )
    return first, second


def test_a_transition_never_waits_on_itself_when_one_database_dsn_sets_another_timezone(
    make_dbs: Callable[[int], list[str]], clean_env: pytest.MonkeyPatch
) -> None:
    """Shard a moves from one DSN of a database to another DSN of the same database (the
    docs' `host=127.0.0.1` / `host=localhost` case); the second DSN's sessions run with
    another TimeZone. The database is one (same server start, same oid), so the
    transition must lock a name there once; a wait must not wait on its own lock."""
    (base,) = make_dbs(1)
    first, second = _one_database_two_ways(base)
    with connect(first) as c1, connect(second) as c2:
        assert c1.info.backend_pid != c2.info.backend_pid
        same_db = (
            c1.execute("SELECT oid FROM pg_database WHERE datname = current_database()").fetchone()
            == c2.execute(
                "SELECT oid FROM pg_database WHERE datname = current_database()"
            ).fetchone()
        )
        assert same_db
    old, new = {"a": first}, {"a": second}
    o, t, _ = configs(old, new)
    name = "tenant:one-database"
    # The record, written once on the one database (through its first DSN).
    Rollout([("a", first)], o.map_identity, connect).init()  # type: ignore[arg-type]
    Rollout([("a", first)], t.map_identity, connect).begin()  # type: ignore[arg-type]
    waiting = AdvisoryLock(name, config=t, wait=True, timeout=3)
    started = time.monotonic()
    outcome = "granted"
    try:
        try:
            if not waiting.acquire():
                outcome = "not granted"
            elif not waiting.acquired:
                outcome = "acquire() returned True but the lock is not held (acquired=False)"
        except LockTimeout as exc:
            outcome = f"LockTimeout after {time.monotonic() - started:.1f}s: {exc}"
        with contextlib.suppress(Exception):
            waiting.release()
        tried = AdvisoryLock(name, config=t)
        got_try = try_hold(tried)
        with contextlib.suppress(Exception):
            tried.release()
    finally:
        with contextlib.suppress(Exception):
            waiting.release()
        registry.close()
    assert outcome == "granted", (
        "the transition could not take a free name once on its one database: its two "
        "DSNs of it were told apart by the text of pg_postmaster_start_time(), which "
        f"depends on the session's TimeZone (known: {rollout._databases}), so its wait "
        "met its own previous-shard lock; outcome: "
        f"{outcome} (with the previous lock kept, the wait would wait on itself)"
    )
    assert got_try, "a transition try_lock of a free name on one database is refused for ever"


def test_a_step_over_one_database_under_two_dsns_does_not_wait_on_itself(
    make_dbs: Callable[[int], list[str]],
    clean_env: pytest.MonkeyPatch,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The same two DSNs of one database given to `pglock-celery shards begin`: the step
    must take that database's record once ("the steps write its record once"), not lock
    it from two sessions (the second waiting on the first until the step lock wait ends:
    30 s, here cut to 2 s)."""
    (base,) = make_dbs(1)
    first, second = _one_database_two_ways(base)
    monkeypatch.setattr(rollout, "STEP_LOCK_WAIT", "2s")
    old, new = {"a": first}, {"a": second}
    operator(clean_env, old).init()
    refused = None
    try:
        operator(clean_env, new, old).begin()
    except RolloutRefused as exc:
        refused = exc
    assert refused is None, (
        f"begin over one database under two DSNs waited on its own step lock: {refused}"
    )


# -- the try-before-wait path of a moving name ---------------------------------------------


def _waiting_on(dsn: str, deadline: float) -> bool:
    """Whether some session waits for an advisory lock in ``dsn``'s database."""
    with connect(dsn) as conn:
        while time.monotonic() < deadline:
            row = conn.execute(
                "SELECT count(*) FROM pg_locks l JOIN pg_database d ON d.oid = l.database"
                " WHERE l.locktype = 'advisory' AND NOT l.granted"
                " AND d.datname = current_database()"
            ).fetchone()
            if row and row[0]:
                return True
            time.sleep(0.05)
    return False


def test_a_transition_wait_for_a_busy_new_shard_keeps_its_previous_shard_lock(
    make_dbs: Callable[[int], list[str]], clean_env: pytest.MonkeyPatch
) -> None:
    """After begin (old map and transition accepted). A transition holder T1 of a moving
    name loses its lock on the previous shard (its backend ended, as in a restart of
    that server): its new-shard lock lingers until it releases. A second transition
    worker T2 waits for the name: it takes the previous shard's lock, tries the new one
    (busy) and waits. While it waits and once granted it must still hold the previous
    shard's lock, or an old-map worker locks the name there beside it."""
    a, b, c = make_dbs(3)
    old, new = {"a": a, "b": b}, {"a": a, "b": b, "c": c}
    name = moving_name(old, new)
    o, t, n = configs(old, new)
    key = lock_key(name)
    before, after = o.for_key(key, name).dsn, n.for_key(key, name).dsn
    assert before and after and before != after
    operator(clean_env, old).init()
    operator(clean_env, new, old).begin()
    first = AdvisoryLock(name, config=t)
    second = AdvisoryLock(name, config=t, wait=True, timeout=8)
    old_worker = AdvisoryLock(name, config=o)
    result: list[object] = []
    waiter = threading.Thread(target=lambda: result.append(_outcome(second.acquire)))
    during = after_grant = False
    previous_held = None
    try:
        assert first.acquire(), "the first transition holder did not get the name"
        assert first._previous is not None
        lost_pid = first._previous.backend_pid
        with connect(before) as conn:
            conn.execute("SELECT pg_terminate_backend(%s, 5000)", (lost_pid,))
        waiter.start()
        assert _waiting_on(after, time.monotonic() + 5), "T2 never waited on the new shard"
        # While T2 waits for the new shard: is its previous shard's lock still taken?
        during = try_hold(old_worker)
        if during:
            old_worker.release()
        with contextlib.suppress(Exception):
            first.release()
        waiter.join(10)
        assert not waiter.is_alive()
        previous_held = second.acquired
        if result and result[0] is True:
            after_grant = try_hold(old_worker)
    finally:
        for lock in (old_worker, second, first):
            with contextlib.suppress(Exception):
                lock.release()
        registry.close()
    assert not (during or after_grant), (
        f"two holders of {name!r}: T2's acquire returned {result} (T2.acquired="
        f"{previous_held}) after letting its previous shard's lock go before waiting for "
        "the new shard (the refused try's cleanup in _acquire releases self._previous "
        f"too); an old-map worker then locked the name on its old shard (while T2 waited: "
        f"{during}; after T2 was granted: {after_grant})"
    )


def _outcome(call: Callable[[], object]) -> object:
    try:
        return call()
    except Exception as exc:
        return exc


def test_a_transition_lock_acquired_again_after_a_refusal_keeps_its_previous_shard_lock(
    make_dbs: Callable[[int], list[str]], clean_env: pytest.MonkeyPatch
) -> None:
    """After finish, a new-map worker holds a moving name on its new shard; a transition
    lock is refused there, then acquired again by the same object once free: it holds
    the name on both shards (the retry lets go of the refused try alone)."""
    a, b, c = make_dbs(3)
    old, new = {"a": a, "b": b}, {"a": a, "b": b, "c": c}
    name = moving_name(old, new)
    _, t, n = configs(old, new)
    rollout = operator(clean_env, new, old)
    rollout.begin()
    assert rollout.finish(5, lambda _: None) == (False, {})
    previous_dsn = PglockConfig(shards=parse_shards(old)).for_key(lock_key(name), name).dsn
    assert previous_dsn is not None
    newer, again = AdvisoryLock(name, config=n), AdvisoryLock(name, config=t)
    try:
        assert newer.acquire()
        assert not again.acquire(), "a transition holder beside a new-map one"
        newer.release()
        assert again.acquire(), "refused a free name"
        with connect(previous_dsn) as conn:
            held = conn.execute(
                "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted"
                " AND objsubid = 1 AND ((classid::bigint << 32) | objid::bigint) = %s"
                " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())",
                (lock_key(name),),
            ).fetchone()
        assert held == (1,), "the retry let go of the previous shard's lock"
    finally:
        for lock in (again, newer):
            with contextlib.suppress(Exception):
                lock.release()
        registry.close()
