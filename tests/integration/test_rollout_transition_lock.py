"""The transition lock (a moving name during a change of the shards: docs/shards.md
"Changing the shards") after its acquire: one lock over two shards, its loss on the
previous one its loss (held, the body, lock.transaction() at its start and at its
commit, release), holder() where it was refused, a fork, an exception in the body.

Real Postgres only: databases pglock_rollout_<random> on the test server (dropped after).
Holders are in-process AdvisoryLock objects of the old map, the transition and the new
map (distinct application_name prefixes); the operator's steps are the Rollout that
`pglock-celery shards` builds (cli._rollout, from PGLOCK_* in the environment).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator

import psycopg
import pytest

from pglock_celery import LockLost, PglockError
from pglock_celery.config import PglockConfig
from pglock_celery.keys import lock_key
from pglock_celery.lock import AdvisoryLock
from pglock_celery.sources import registry
from tests.support.rollout import configs, let_go, moving, operator

STRATEGIES = ["reuse", "connect", "shared"]

# -- set-up ---------------------------------------------------------------------------


def kill_transition_sessions(dsn: str) -> list[int]:
    """pg_terminate_backend every session of the transition's prefix on ``dsn``'s database
    (idle ones too); wait until they are gone."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        pids = [
            r[0]
            for r in conn.execute(
                "SELECT pid FROM pg_stat_activity WHERE datname = current_database()"
                " AND application_name LIKE 'pglock-tr%%'"
            ).fetchall()
        ]
        for pid in pids:
            conn.execute("SELECT pg_terminate_backend(%s, 5000)", (pid,))
    return pids


@contextlib.contextmanager
def transition_begun(
    make_dbs: Callable[[int], list[str]], env: pytest.MonkeyPatch, **settings: object
) -> Iterator[tuple[str, str, str, tuple[PglockConfig, PglockConfig, PglockConfig]]]:
    """Two shards growing to three, init and begin run; a moving name, its two DSNs,
    and the three maps' configurations."""
    a, b, c = make_dbs(3)
    old, new = {"a": a, "b": b}, {"a": a, "b": b, "c": c}
    operator(env, old).init()
    operator(env, new, old).begin()
    name, before, now = moving(old, new)
    try:
        yield name, before, now, configs(old, new, **settings)
    finally:
        registry.close()


# -- the previous shard's lock lost while the body runs ---------------------------------


@pytest.mark.parametrize("strategy", ["reuse", "connect"])
def test_transaction_of_a_moving_name_refuses_once_its_previous_shard_lock_is_gone(
    make_dbs: Callable[[int], list[str]], clean_env: pytest.MonkeyPatch, strategy: str
) -> None:
    """lock.transaction() proves the lock before it lets the body write, and commits only
    while it is held. For a moving name the lock is the pair: once the previous shard's
    session is gone (pg_terminate_backend), an old-map worker takes the name there, and
    the transition's transaction must refuse (LockLost) rather than commit beside it."""
    # The default check interval (2 s): the transaction comes within ~0.1 s of the kill.
    with transition_begun(make_dbs, clean_env, strategy=strategy) as (
        name, before, now, (o, t, _),
    ):  # fmt: skip
        with psycopg.connect(now, autocommit=True) as conn:
            conn.execute("CREATE TABLE probe_writes (v text)")
        tr = AdvisoryLock(name, config=t)
        old_worker = AdvisoryLock(name, config=o)
        committed = False
        error: BaseException | None = None
        try:
            assert tr.acquire(), "the transition did not take a free moving name"
            assert kill_transition_sessions(before), "no transition session on the old shard"
            assert old_worker.acquire(), "setup: the old-map worker could not take the name"
            try:
                with tr.transaction() as conn:
                    conn.execute("INSERT INTO probe_writes VALUES ('under the lock')")
                committed = True
            except LockLost as exc:
                error = exc
        finally:
            let_go(old_worker, tr)
        with psycopg.connect(now, autocommit=True) as conn:
            rows = conn.execute("SELECT count(*) FROM probe_writes").fetchone()
        assert not committed and error is not None, (
            f"[{strategy}] lock.transaction() of the moving name {name!r} committed a write "
            f"({rows[0] if rows else '?'} row(s)) after the lock's session on its previous "
            "shard was terminated, while an old-map worker held the name there: two holders, "
            "the transaction proves only the new shard's half of the lock"
        )


@pytest.mark.parametrize("strategy", ["reuse", "connect"])
def test_transaction_of_a_moving_name_commits_nothing_when_its_previous_shard_lock_goes_meanwhile(
    make_dbs: Callable[[int], list[str]], clean_env: pytest.MonkeyPatch, strategy: str
) -> None:
    """The previous shard's session ends while the transaction's body runs (and an
    old-map worker takes the name there): the commit is refused, nothing written."""
    with transition_begun(make_dbs, clean_env, strategy=strategy) as (
        name, before, now, (o, t, _),
    ):  # fmt: skip
        with psycopg.connect(now, autocommit=True) as conn:
            conn.execute("CREATE TABLE probe_writes (v text)")
        tr = AdvisoryLock(name, config=t)
        old_worker = AdvisoryLock(name, config=o)
        try:
            assert tr.acquire()
            with pytest.raises(LockLost, match="previous shard"):
                with tr.transaction() as conn:
                    conn.execute("INSERT INTO probe_writes VALUES ('under the lock')")
                    assert kill_transition_sessions(before), "no transition session there"
                    assert old_worker.acquire(), "setup: the old-map worker was refused"
            assert tr.loss is not None, "the loss was not kept"
        finally:
            let_go(old_worker, tr)
        with psycopg.connect(now, autocommit=True) as conn:
            rows = conn.execute("SELECT count(*) FROM probe_writes").fetchone()
        assert rows == (0,), f"[{strategy}] committed beside an old-map holder"


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_held_of_a_moving_name_is_false_once_its_previous_shard_lock_is_gone(
    make_dbs: Callable[[int], list[str]], clean_env: pytest.MonkeyPatch, strategy: str
) -> None:
    """held() asks both shards: the previous shard's loss is the lock's loss."""
    with transition_begun(make_dbs, clean_env, strategy=strategy, check_interval=60) as (
        name, before, _now, (_, t, _n),
    ):  # fmt: skip
        tr = AdvisoryLock(name, config=t)
        try:
            assert tr.acquire()
            assert tr.held()
            assert kill_transition_sessions(before)
            still = tr.held()
            loss = tr.loss
            with pytest.raises(LockLost):
                tr.ensure_held()
            conn_refused = False
            try:
                tr.connection.execute("SELECT 1")
            except (LockLost, PglockError):
                conn_refused = True
        finally:
            with contextlib.suppress(Exception):
                tr.release()
        assert not still, f"[{strategy}] held() is True after the previous shard's lock went"
        assert loss is not None, f"[{strategy}] lock.loss is None after held() found the loss"
        assert conn_refused, f"[{strategy}] lock.connection still usable after the loss"


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_body_of_a_moving_name_is_interrupted_when_its_previous_shard_lock_is_gone(
    make_dbs: Callable[[int], list[str]], clean_env: pytest.MonkeyPatch, strategy: str
) -> None:
    """lock.sleep() (the body) raises LockLost within the check bound once the previous
    shard's session is terminated, and the new shard's lock is let go."""
    with transition_begun(make_dbs, clean_env, strategy=strategy, check_interval=0.5) as (
        name, before, now, (_, t, n),
    ):  # fmt: skip
        tr = AdvisoryLock(name, config=t)
        newer = AdvisoryLock(name, config=n)
        interrupted = None
        try:
            assert tr.acquire()
            kill_transition_sessions(before)
            started = time.monotonic()
            try:
                tr.sleep(10)
            except LockLost:
                interrupted = time.monotonic() - started
            # the new shard's half is let go too: a taker there (by key, on the new DB)
            freed = False
            with psycopg.connect(now, autocommit=True) as conn:
                for _ in range(40):
                    got = conn.execute(
                        "SELECT pg_try_advisory_lock(%s)", (lock_key(name),)
                    ).fetchone()
                    if got and got[0]:
                        conn.execute("SELECT pg_advisory_unlock_all()")
                        freed = True
                        break
                    time.sleep(0.1)
        finally:
            let_go(tr, newer)
        assert interrupted is not None, f"[{strategy}] the body slept on: no LockLost"
        assert interrupted < 8, f"[{strategy}] LockLost came after {interrupted:.1f}s"
        assert freed, f"[{strategy}] the new shard's lock stayed held after the loss"


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_release_of_a_moving_name_whose_previous_lock_was_lost_raises_and_keeps_the_loss(
    make_dbs: Callable[[int], list[str]], clean_env: pytest.MonkeyPatch, strategy: str
) -> None:
    """A release that finds the previous shard's lock gone raises LockLost, frees the new
    shard's lock, and lock.loss says why (its loss is the lock's loss)."""
    with transition_begun(make_dbs, clean_env, strategy=strategy, check_interval=60) as (
        name, before, now, (_, t, _n),
    ):  # fmt: skip
        tr = AdvisoryLock(name, config=t)
        raised = None
        try:
            assert tr.acquire()
            kill_transition_sessions(before)
            try:
                tr.release()
            except LockLost as exc:
                raised = exc
            loss = tr.loss
        finally:
            with contextlib.suppress(Exception):
                tr.release()
        with psycopg.connect(now, autocommit=True) as conn:
            got = conn.execute("SELECT pg_try_advisory_lock(%s)", (lock_key(name),)).fetchone()
        assert got and got[0], f"[{strategy}] the new shard's lock stayed held after release"
        assert raised is not None, (
            f"[{strategy}] release() returned quietly though the previous shard's lock had "
            "been lost while held"
        )
        assert loss is not None, (
            f"[{strategy}] release() raised LockLost ({raised}) for the previous shard's "
            "loss, but lock.loss / lost_reason is None afterwards: the loss on the previous "
            "shard is not recorded as the lock's loss"
        )


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_holder_of_a_moving_name_refused_on_its_previous_shard_names_the_holder(
    make_dbs: Callable[[int], list[str]], clean_env: pytest.MonkeyPatch, strategy: str
) -> None:
    """A try of a moving name refused because an old-map worker holds it on its previous
    shard: holder() (what a skip reports) names that worker, not 'nobody'."""
    with transition_begun(make_dbs, clean_env, strategy=strategy) as (
        name, _before, _now, (o, t, _),
    ):  # fmt: skip
        old_worker = AdvisoryLock(name, config=o)
        tr = AdvisoryLock(name, config=t)
        try:
            assert old_worker.acquire()
            assert not tr.acquire(), "two holders: the transition took a held moving name"
            who = tr.holder()
        finally:
            let_go(tr, old_worker)
        assert who is not None, (
            f"[{strategy}] holder() of the moving name {name!r}, refused because an old-map "
            "worker holds it on its previous shard, says nobody holds it (a skip reports "
            "'unknown', a redelivered copy is not recognised)"
        )


def _key_free_on(dsn: str, key: int) -> bool:
    with psycopg.connect(dsn, autocommit=True) as conn:
        got = conn.execute("SELECT pg_try_advisory_lock(%s)", (key,)).fetchone()
        return bool(got and got[0])


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_fork_after_acquire_of_a_moving_name_keeps_both_halves_in_the_parent(
    make_dbs: Callable[[int], list[str]], clean_env: pytest.MonkeyPatch, strategy: str
) -> None:
    """A child forked while the parent holds a moving name does not hold it (acquired is
    False there) and its release frees neither shard's lock: the parent still holds both."""
    with transition_begun(make_dbs, clean_env, strategy=strategy) as (
        name, before, now, (_, t, _n),
    ):  # fmt: skip
        tr = AdvisoryLock(name, config=t)
        try:
            assert tr.acquire()
            pid = os.fork()
            if pid == 0:  # the child: report through the exit status
                code = 0
                try:
                    if tr.acquired:
                        code = 3
                    with contextlib.suppress(BaseException):
                        tr.release()
                finally:
                    os._exit(code)
            _, status = os.waitpid(pid, 0)
            child = os.waitstatus_to_exitcode(status)
            time.sleep(0.3)
            key = lock_key(name)
            old_free, new_free = _key_free_on(before, key), _key_free_on(now, key)
            still = tr.held()
        finally:
            with contextlib.suppress(Exception):
                tr.release()
        assert child == 0, f"[{strategy}] the forked child saw the moving name as acquired"
        assert not old_free and not new_free and still, (
            f"[{strategy}] after a forked child's release the parent's lock is gone: "
            f"previous shard free={old_free}, new shard free={new_free}, held()={still}"
        )


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_an_exception_in_the_body_of_a_moving_name_frees_both_shards(
    make_dbs: Callable[[int], list[str]], clean_env: pytest.MonkeyPatch, strategy: str
) -> None:
    """`with lock:` whose body raises: the body's exception comes out and both halves are
    let go, even when the previous shard's half was lost meanwhile."""
    with transition_begun(make_dbs, clean_env, strategy=strategy, check_interval=60) as (
        name, before, now, (_, t, _n),
    ):  # fmt: skip
        tr = AdvisoryLock(name, config=t, wait=True, timeout=5)
        with pytest.raises(ValueError):
            with tr:
                assert tr.acquired
                raise ValueError("body failed")
        key = lock_key(name)
        assert _key_free_on(before, key) and _key_free_on(now, key), "a half stayed held"
        tr2 = AdvisoryLock(name, config=t)
        with pytest.raises(ValueError):
            with tr2:
                kill_transition_sessions(before)
                raise ValueError("body failed after the loss")
        assert _key_free_on(before, key) and _key_free_on(now, key), "a half stayed held"
