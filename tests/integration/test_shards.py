"""Locks spread over three databases (pglock_shards): each name taken, excluded and
written on its own shard only; a shard that is down fails closed for its names alone."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import psycopg
import pytest
from celery import Celery
from psycopg.conninfo import make_conninfo

from pglock_celery import AdvisoryLock, LockUnavailable, TenantLockedTask, current_lock
from pglock_celery.config import PglockConfig
from pglock_celery.keys import lock_key
from pglock_celery.shards import parse_shards
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
            rival.execute("SELECT pg_advisory_lock(%s)", (lock_key(f"shard-task:{tenant}"),))
            assert step.apply(args=(tenant,)).result != "ran"
        assert step.apply(args=(tenant,)).result == "ran"
        assert seen[tenant] == config.for_key(lock_key(f"shard-task:{tenant}")).dsn
