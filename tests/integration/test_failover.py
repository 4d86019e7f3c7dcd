"""G4 and G2 through a failover: a primary, its pg_basebackup standby, promotion, demotion."""

from __future__ import annotations

import time
from collections.abc import Iterator

import psycopg
import pytest

from pglock_celery import LockLost, LockUnavailable, try_lock
from pglock_celery.config import PglockConfig
from pglock_celery.lock import AdvisoryLock
from tests.support.services import EmbeddedPostgres, wait_until


def in_recovery(server: EmbeddedPostgres) -> bool:
    with psycopg.connect(server.socket_dsn) as conn:
        row = conn.execute("SELECT pg_is_in_recovery()").fetchone()
    return bool(row and row[0])


def streams_to_a_standby(server: EmbeddedPostgres) -> bool:
    with psycopg.connect(server.socket_dsn) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_replication WHERE state = 'streaming'"
        ).fetchone()
    return bool(row and row[0])


@pytest.fixture
def pair(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[EmbeddedPostgres, EmbeddedPostgres]]:
    """A primary and a streaming standby of it, both the test's own."""
    primary = EmbeddedPostgres(tmp_path_factory.mktemp("failover-primary"))
    primary.init()
    primary.start()
    standby = None
    try:
        standby = primary.standby(tmp_path_factory.mktemp("failover-standby"))
        standby.start()
        wait_until(lambda: streams_to_a_standby(primary), 30, "the standby to stream")
        yield primary, standby  # type: ignore[misc]
    finally:
        if standby is not None:
            standby.destroy()
        primary.destroy()


def refuses_locks(server: EmbeddedPostgres, name: str) -> str:
    """The reason a lock on ``server`` is refused; fails if the body would have run."""
    with pytest.raises(LockUnavailable) as refused, try_lock(name, dsn=server.dsn):
        pytest.fail(f"a lock was granted on {server.dsn}, which is in recovery")
    return str(refused.value)


def test_a_failover_loses_the_holders_lock_and_only_the_new_primary_grants_it(
    pair: tuple[EmbeddedPostgres, EmbeddedPostgres], run_id: str
) -> None:
    primary, standby = pair
    name = f"failover:{run_id}"
    assert "read-only" in refuses_locks(standby, name)  # a standby never grants a lock

    held = AdvisoryLock(name, config=PglockConfig(dsn=primary.dsn, check_interval=0.2))
    assert held.acquire()
    primary.stop("fast")  # the primary goes away with its sessions
    stopped_at = time.monotonic()
    with pytest.raises(LockLost, match="lock session failed"):
        held.sleep(10)
    learned = time.monotonic() - stopped_at
    with pytest.raises(LockLost):
        held.release()

    with psycopg.connect(standby.socket_dsn, autocommit=True) as conn:
        conn.execute("SELECT pg_promote(true, 30)")
    assert not in_recovery(standby)
    with try_lock(name, dsn=standby.dsn) as taken:
        assert taken.acquired  # the promoted server serves locks

    # The old primary comes back demoted: a standby of the new one.
    (primary.data / "standby.signal").touch()
    with (primary.data / "postgresql.auto.conf").open("a") as conf:
        conf.write(
            f"primary_conninfo = 'host={standby.sockets} port={standby.port} user=postgres'\n"
        )
    primary.start()
    assert in_recovery(primary)
    assert "read-only" in refuses_locks(primary, name)
    print(f"\nfailover: the holder learned of the loss {learned:.2f} s after the primary stopped")
    assert learned < 2
