"""Locks spread over three databases (pglock_shards): each name taken, excluded and
written on its own shard only; a shard that is down fails closed for its names alone."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import psycopg
import pytest
from celery import Celery
from psycopg.conninfo import make_conninfo

from pglock_celery import (
    AdvisoryLock,
    LockLost,
    LockUnavailable,
    TenantLockedTask,
    current_lock,
)
from pglock_celery.config import PglockConfig
from pglock_celery.keys import lock_key
from pglock_celery.rollout import Rollout
from pglock_celery.shards import parse_shards
from pglock_celery.sources import registry
from tests.support.locks import DEDICATED, free_elsewhere
from tests.support.services import free_port, own_database, scalar


@pytest.fixture(scope="module")
def three(pg_dsn: str) -> Iterator[dict[str, str]]:
    """Three databases of this run's own on the test server: shards a, b and c."""
    with own_database(pg_dsn) as a, own_database(pg_dsn) as b, own_database(pg_dsn) as c:
        yield {"a": a, "b": b, "c": c}


def names_on(
    config: PglockConfig, shard: str, count: int = 1, prefix: str = "shard-test:"
) -> list[str]:
    """``count`` fresh lock names (``prefix`` and a random part) placed on ``shard``."""
    found: list[str] = []
    while len(found) < count:
        name = f"{prefix}{uuid.uuid4().hex[:10]}"
        if config.shard_of(lock_key(name), name) == shard:
            found.append(name)
    return found


def sharded(shards: dict[str, str], **settings: object) -> PglockConfig:
    return PglockConfig(shards=parse_shards(shards), **settings)  # type: ignore[arg-type]


@pytest.mark.parametrize("strategy", ["reuse", "connect", "shared"])
def test_each_name_is_held_and_excluded_on_its_own_shard_only(
    three: dict[str, str], strategy: str
) -> None:
    config = sharded(three, strategy=strategy)
    for shard, dsn in three.items():
        [name] = names_on(config, shard)
        held = AdvisoryLock(name, config=config)
        with held:
            assert held.acquired
            assert held.config.dsn == dsn
            rival = AdvisoryLock(name, config=config)
            assert not rival.acquire(), "a second holder of one name on its shard"
            assert not free_elsewhere(dsn, name)
            # Advisory locks belong to one database: the other shards know nothing of it.
            for other, other_dsn in three.items():
                if other != shard:
                    assert free_elsewhere(other_dsn, name), (name, other)
        assert free_elsewhere(dsn, name)


def test_names_spread_over_every_shard(three: dict[str, str]) -> None:
    config = sharded(three)
    held = [AdvisoryLock(f"spread:{i}:{uuid.uuid4().hex[:6]}", config=config) for i in range(60)]
    try:
        for lock in held:
            assert lock.acquire()
        for shard, dsn in three.items():
            count = scalar(dsn, "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' "
                                "AND database = (SELECT oid FROM pg_database "
                                "WHERE datname = current_database())")  # fmt: skip
            placed = sum(1 for lock in held if lock.config.dsn == dsn)
            assert placed > 5, (shard, placed)  # 60 names over 3 shards
            assert count >= placed  # each held on its shard (twice under reuse: its pin)
    finally:
        for lock in held:
            lock.release()


def test_a_shard_that_is_down_fails_closed_for_its_names_while_the_others_run_on(
    three: dict[str, str],
) -> None:
    down = make_conninfo(three["b"], host="127.0.0.1", port=str(free_port()))
    config = sharded({**three, "b": down}, connect_timeout=2)
    [on_b] = names_on(config, "b")
    with pytest.raises(LockUnavailable):
        AdvisoryLock(on_b, config=config).acquire()
    for shard in ("a", "c"):
        [name] = names_on(config, shard)
        with AdvisoryLock(name, config=config) as held:
            assert held.acquired


@pytest.mark.parametrize("strategy", DEDICATED)
def test_a_fenced_write_lands_in_the_names_shard(three: dict[str, str], strategy: str) -> None:
    for dsn in three.values():
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("CREATE TABLE IF NOT EXISTS shard_writes (name text NOT NULL)")
    config = sharded(three, strategy=strategy)
    for shard, dsn in three.items():
        [name] = names_on(config, shard)
        with AdvisoryLock(name, config=config) as held, held.transaction() as conn:
            conn.execute("INSERT INTO shard_writes VALUES (%s)", (name,))
        for other_dsn in three.values():
            rows = scalar(other_dsn, "SELECT count(*) FROM shard_writes WHERE name = %s", (name,))
            assert rows == (1 if other_dsn == dsn else 0), (shard, other_dsn)


def test_a_task_takes_its_lock_on_the_shard_of_its_name(three: dict[str, str]) -> None:
    app = Celery("shards", set_as_current=False, broker="memory://", backend="cache+memory://")
    app.conf.update(pglock_shards=three, task_store_eager_result=True)
    config = sharded(three)
    seen: dict[str, str | None] = {}

    @app.task(base=TenantLockedTask, lock_name="shard-task:{tenant}", shared=False)
    def step(tenant: str) -> str:
        lock = current_lock()
        assert lock is not None
        seen[tenant] = lock.config.dsn
        return "ran"

    for shard, dsn in three.items():
        [name] = names_on(config, shard, prefix="shard-task:")
        tenant = name.split(":", 1)[1]
        # Another session of the same shard holds the name: the task skips.
        with psycopg.connect(dsn, autocommit=True) as rival:
            key = lock_key(f"shard-task:{tenant}")
            rival.execute("SELECT pg_advisory_lock(%s)", (key,))
            assert step.apply(args=(tenant,)).result != "ran"
            # Let go in a statement: a closed connection's backend ends, and frees the
            # lock, after the client has moved on.
            rival.execute("SELECT pg_advisory_unlock(%s)", (key,))
        assert step.apply(args=(tenant,)).result == "ran"
        assert seen[tenant] == config.for_key(lock_key(f"shard-task:{tenant}")).dsn


@pytest.fixture
def recorded(three: dict[str, str]) -> Iterator[None]:
    """The record of the maps on every shard, accepting the old map (a, b), the new one
    (a, b, c) and the change between them, so that holders of all three meet on the
    locks alone (the fence that keeps old and new apart: test_rollout_states.py)."""
    two, every = parse_shards({"a": three["a"], "b": three["b"]}), parse_shards(three)
    maps = [
        PglockConfig(shards=shards, shards_previous=previous).map_identity
        for shards, previous in ((two, None), (every, None), (every, two))
    ]
    assert maps[2] is not None
    rollout = Rollout(list(three.items()), maps[2], connect)
    rollout.accept(m.name for m in maps if m is not None)
    yield
    registry.close()  # sessions that recorded a map in the tables dropped now
    for dsn in three.values():
        scalar(dsn, "DROP TABLE pglock_shard_maps, pglock_shard_sessions")


def connect(dsn: str) -> psycopg.Connection:
    return psycopg.connect(dsn, autocommit=True)


def moving_name(before: PglockConfig, after: PglockConfig, prefix: str = "moving:") -> str:
    """A fresh name whose shard's database differs between the two maps."""
    while True:
        name = f"{prefix}{uuid.uuid4().hex[:10]}"
        key = lock_key(name)
        if before.for_key(key, name).dsn != after.for_key(key, name).dsn:
            return name


@pytest.mark.parametrize("strategy", ["reuse", "connect", "shared"])
def test_while_the_shards_change_a_moving_name_excludes_workers_on_either_map(
    three: dict[str, str], recorded: None, strategy: str
) -> None:
    """From shards a, b to a, b, c: with pglock_shards_previous, a moving name is locked
    on its previous shard first, then on its new one, so a holder on the previous map
    and a holder on the new map each keep the transition's lock out, and it holds both."""
    two = {"a": three["a"], "b": three["b"]}
    old = sharded(two, strategy=strategy)
    new = sharded(three, strategy=strategy)
    moving = PglockConfig(
        shards=parse_shards(three), shards_previous=parse_shards(two), strategy=strategy
    )
    name = moving_name(old, new)
    then, now = old.for_key(lock_key(name), name).dsn, new.for_key(lock_key(name), name).dsn
    for holder in (old, new):
        with AdvisoryLock(name, config=holder) as held:
            assert held.acquired
            assert not AdvisoryLock(name, config=moving).acquire()
        # Nothing of the refused transition lock stays held, on either shard.
        assert free_elsewhere(then, name) and free_elsewhere(now, name)
    with AdvisoryLock(name, config=moving) as both:
        assert both.acquired and both.held()
        assert not free_elsewhere(then, name) and not free_elsewhere(now, name)
        for holder in (old, new):
            assert not AdvisoryLock(name, config=holder).acquire()
        assert both.config.dsn == now  # its connection is on the new shard
    assert free_elsewhere(then, name) and free_elsewhere(now, name)


def test_a_name_that_stays_put_is_locked_once_while_the_shards_change(
    three: dict[str, str],
    recorded: None,
) -> None:
    two = {"a": three["a"], "b": three["b"]}
    old, new = sharded(two), sharded(three)
    moving = PglockConfig(shards=parse_shards(three), shards_previous=parse_shards(two))
    while True:
        name = f"staying:{uuid.uuid4().hex[:10]}"
        if old.for_key(lock_key(name), name).dsn == new.for_key(lock_key(name), name).dsn:
            break
    assert moving.previous_for_key(lock_key(name), name) is None
    with AdvisoryLock(name, config=moving) as held:
        assert held.acquired and held._previous is None


def test_losing_the_previous_shards_lock_is_losing_the_lock(
    three: dict[str, str], recorded: None
) -> None:
    two = {"a": three["a"], "b": three["b"]}
    moving = PglockConfig(
        shards=parse_shards(three), shards_previous=parse_shards(two), check_interval=0.2
    )
    name = moving_name(sharded(two), sharded(three))
    then = sharded(two).for_key(lock_key(name), name).dsn
    held = AdvisoryLock(name, config=moving)
    assert held.acquire()
    previous = held._previous
    assert previous is not None and previous.backend_pid is not None
    scalar(then, "SELECT pg_terminate_backend(%s)", (previous.backend_pid,))
    with pytest.raises(LockLost, match="on its previous shard"):
        held.sleep(10)
    assert held.loss is not None and not held.held()
    with pytest.raises(LockLost):  # a lost lock's release says so
        held.release()
    assert free_elsewhere(moving.for_key(lock_key(name), name).dsn, name)
