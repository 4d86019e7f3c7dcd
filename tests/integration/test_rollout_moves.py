"""The fence of a change of the shards when shards move (docs/shards.md, "Changing the
shards"; docs/limits.md 30-32): going back while finish waits, a shard moved to another
database under its name, a shard moved to a promoted standby of its server.

Real Postgres only: databases pglock_rollout_<random> on the test server (dropped after),
and, where two servers must share a system identifier, embedded servers of the module's
own (a primary and a promoted streaming standby of it). Holders are in-process AdvisoryLock
objects of the old map, the transition and the new map (distinct application_name
prefixes); the operator's steps are the Rollout that `pglock-celery shards` builds
(cli._rollout, from PGLOCK_* in the environment).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg
import pytest
from psycopg import sql as psql
from psycopg.conninfo import make_conninfo

from pglock_celery import LockTimeout
from pglock_celery import sql as lsql
from pglock_celery.config import PglockConfig
from pglock_celery.keys import lock_key
from pglock_celery.lock import AdvisoryLock
from pglock_celery.rollout import RolloutRefused, database_of
from pglock_celery.shards import parse_shards
from pglock_celery.sources import registry
from tests.support.rollout import configs, let_go, moving_name, operator, try_hold
from tests.support.services import EmbeddedPostgres

# -- set-up -------------------------------------------------------------------------


def records(dsns: list[str]) -> list[list[str] | None]:
    """Each database's accepted maps, None where it keeps no record."""
    found: list[list[str] | None] = []
    for dsn in dsns:
        with psycopg.connect(dsn, autocommit=True) as conn:
            exists = conn.execute(lsql.SHARD_RECORD_EXISTS).fetchone()
            if not (exists and exists[0]):
                found.append(None)
                continue
            rows = conn.execute(lsql.ACCEPTED_MAPS).fetchall()
            found.append([r[0] for r in rows])
    return found


# -- going back while finish waits ----------------------------------------------------


def test_going_back_while_old_sessions_remain_does_not_accept_the_new_map_beside_them(
    make_dbs: Callable[[int], list[str]], clean_env: pytest.MonkeyPatch
) -> None:
    """`finish` exits 1: an old-map worker is still connected (holding a moving name);
    the record accepts the transition alone. The operator goes back with the reverse
    change's `begin` (pglock_shards = OLD, pglock_shards_previous = NEW): it would accept
    NEW beside a connected old-map session, so it is refused, and no new-map worker
    takes the name."""
    a, b, c = make_dbs(3)
    old, new = {"a": a, "b": b}, {"a": a, "b": b, "c": c}
    name = moving_name(old, new)
    o, _, n = configs(old, new)
    forward = operator(clean_env, new, old)
    old_holder = AdvisoryLock(name, config=o)
    newer = AdvisoryLock(name, config=n)
    both = False
    refused = None
    try:
        forward.begin()
        assert old_holder.acquire(), "the old map is refused after begin"
        _, left = forward.finish(0.5, lambda _: None)
        assert left, "finish did not see the old-map holder"
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
        "two holders of one name: the reverse change's begin, run while finish had left "
        "an old-map session connected (record: the transition alone), accepted the new "
        f"map (refused: {refused}); a new-map worker then locked {name!r} on its new "
        "shard while the old-map worker held it on its old one"
    )


# -- two databases under one shard name -------------------------------------------------


def test_a_step_refuses_another_changes_record_on_either_database_of_a_moved_shard(
    make_dbs: Callable[[int], list[str]], clean_env: pytest.MonkeyPatch
) -> None:
    """Moving a shard's database: shard "a" is database A in the old map, B in the new
    one (same shard name, another DSN). Whichever of the two keeps a record of another
    change, `begin` refuses, writing nothing: the two are read apart."""
    one, two = make_dbs(2)
    with psycopg.connect(one, autocommit=True) as c1, psycopg.connect(two, autocommit=True) as c2:
        first = one if database_of(c1) < database_of(c2) else two
    del c1, c2
    # The database the step takes first keeps a record of another change.
    with psycopg.connect(first, autocommit=True) as conn:
        for statement in lsql.CREATE_SHARD_RECORD:
            conn.execute(statement)
        conn.execute(lsql.ACCEPT_MAP, ("0123456789ab",))
    old, new = {"a": one}, {"a": two}
    before = records([one, two])
    refused = None
    try:
        operator(clean_env, new, old).begin()
    except RolloutRefused as exc:
        refused = exc
    after = records([one, two])
    assert refused is not None and after == before, (
        "begin wrote over a record that belongs to another change (it accepted map "
        f"0123456789ab on one of shard a's two databases): before {before}, after {after}"
    )


def test_init_refuses_another_changes_record_on_a_shard_of_its_own_name(
    make_dbs: Callable[[int], list[str]], clean_env: pytest.MonkeyPatch
) -> None:
    """Where each database has a shard name of its own, init refuses another change's
    record on either and writes nothing."""
    one, two = make_dbs(2)
    with psycopg.connect(two, autocommit=True) as conn:
        for statement in lsql.CREATE_SHARD_RECORD:
            conn.execute(statement)
        conn.execute(lsql.ACCEPT_MAP, ("0123456789ab",))
    before = records([one, two])
    with pytest.raises(RolloutRefused):
        operator(clean_env, {"a": one, "b": two}).init()
    assert records([one, two]) == before


# -- a shard moved to a promoted replica ---------------------------------------------------


@pytest.fixture(scope="module")
def primary_and_clones(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[tuple[str, str]]]:
    """Databases app1 and app2 on an embedded primary, and the same databases on a
    streaming standby of it, promoted (another server with the primary's system
    identifier and oids: how a shard's database is commonly moved to another server).
    One pair per test; both servers go after."""
    tmp_path = tmp_path_factory.mktemp("moved-shard")
    started: list[EmbeddedPostgres] = []
    try:
        primary = EmbeddedPostgres(tmp_path / "primary")
        started.append(primary)
        primary.init()
        primary.start()
        with psycopg.connect(primary.dsn, autocommit=True) as conn:
            for database in ("app1", "app2"):
                conn.execute(psql.SQL("CREATE DATABASE {}").format(psql.Identifier(database)))
        clone = primary.standby(tmp_path / "clone")
        started.append(clone)
        clone.start()
        with psycopg.connect(clone.socket_dsn, autocommit=True) as conn:
            conn.execute("SELECT pg_promote(true, 60)")
        pairs = [
            (make_conninfo(primary.dsn, dbname=database), make_conninfo(clone.dsn, dbname=database))
            for database in ("app1", "app2")
        ]
        with psycopg.connect(pairs[0][1], autocommit=True) as conn:
            row = conn.execute("SELECT pg_is_in_recovery()").fetchone()
            assert row == (False,), "the clone was not promoted"
        yield pairs
    finally:
        registry.close()
        for server in reversed(started):
            server.destroy()


@pytest.fixture
def primary_and_clone(primary_and_clones: list[tuple[str, str]]) -> tuple[str, str]:
    """One database's DSN on the primary and on the promoted standby, this test's alone."""
    return primary_and_clones.pop()


def test_a_shard_moved_to_a_promoted_replica_keeps_old_and_transition_holders_apart(
    primary_and_clone: tuple[str, str], clean_env: pytest.MonkeyPatch
) -> None:
    """Shard "a" moves from the primary to a promoted standby of it: another server
    (another lock table) with the same system identifier and the same database oid.
    They are two databases to the fence: `begin` writes the record on both, and a
    transition worker locks the name on both, so an old-map holder excludes it."""
    old_dsn, new_dsn = primary_and_clone
    old, new = {"a": old_dsn}, {"a": new_dsn}
    name = "tenant:moving"  # one shard each: every name moves
    o, t, _ = configs(old, new)
    with (
        psycopg.connect(old_dsn, autocommit=True) as c1,
        psycopg.connect(new_dsn, autocommit=True) as c2,
    ):
        seen = (database_of(c1), database_of(c2))
        ports = (c1.info.port, c2.info.port)
    assert ports[0] != ports[1]
    operator(clean_env, old).init()
    operator(clean_env, new, old).begin()
    written = records([old_dsn, new_dsn])
    old_holder = AdvisoryLock(name, config=o)
    tr = AdvisoryLock(name, config=t)
    both = False
    try:
        assert old_holder.acquire(), "the old map is refused after begin"
        both = try_hold(tr) and old_holder.acquired
    finally:
        let_go(tr, old_holder)
        registry.close()
    assert not both, (
        f"two holders of {name!r}: an old-map worker on the old server (port {ports[0]}) "
        f"and a transition worker on the new one (port {ports[1]}), which the transition "
        f"took for one database (both are {seen[0]!r} / {seen[1]!r}); records after "
        f"begin: old {written[0]}, new {written[1]}"
    )


def test_a_shard_moved_to_a_promoted_replica_is_fenced_for_the_new_map_after_finish(
    primary_and_clone: tuple[str, str], clean_env: pytest.MonkeyPatch
) -> None:
    """The same move carried to its end: after `finish` the old map is refused on both
    servers, so an old-map worker started late (or one whose session reopens) cannot
    lock on the old server while a new-map worker holds on the new one."""
    old_dsn, new_dsn = primary_and_clone
    old, new = {"a": old_dsn}, {"a": new_dsn}
    name = "tenant:moving"
    o, _, n = configs(old, new)
    operator(clean_env, old).init()
    rollout = operator(clean_env, new, old)
    rollout.begin()
    done = rollout.finish(5.0, lambda _: None)
    written = records([old_dsn, new_dsn])
    newer = AdvisoryLock(name, config=n)
    late_old = AdvisoryLock(name, config=o)
    both = False
    try:
        got_new = try_hold(newer)
        both = got_new and try_hold(late_old)
    finally:
        let_go(late_old, newer)
        registry.close()
    assert not both, (
        f"two holders of {name!r} after finish ({done}): a new-map worker on the new "
        f"server and an old-map worker on the old one; records: old {written[0]}, "
        f"new {written[1]}"
    )


# -- one database under two DSNs, its server restarted ---------------------------------------


def test_a_transition_wait_never_waits_on_itself_when_its_two_dsns_reach_one_restarted_server(
    tmp_path: Path, clean_env: pytest.MonkeyPatch
) -> None:
    """Shard a is one database under two DSNs (TCP in the old map, the Unix socket in the
    new one). The transition knew them for one; the server restarts (a failover's new
    primary: another start), and a session on only one of the DSNs opens again. The
    other DSN's knowledge is stale: taken on both, a wait would wait on its own lock on
    the previous shard. It is tried first, learns the truth, and is taken there once."""
    server = EmbeddedPostgres(tmp_path / "one")
    try:
        server.init()
        server.start()
        with psycopg.connect(server.dsn, autocommit=True) as conn:
            for database in ("d", "e"):
                conn.execute(psql.SQL("CREATE DATABASE {}").format(psql.Identifier(database)))
        by_tcp = make_conninfo(server.dsn, dbname="d")
        by_socket = make_conninfo(server.socket_dsn, dbname="d")
        other = make_conninfo(server.dsn, dbname="e")
        old, new = {"a": by_tcp}, {"a": by_socket, "b": other}
        o, t, _ = configs(old, new)
        operator(clean_env, old).init()
        operator(clean_env, new, old).begin()
        placed = PglockConfig(shards=parse_shards(new))

        def on(shard: str) -> str:
            while True:
                name = f"tenant:{uuid.uuid4().hex[:8]}"
                if placed.shard_of(lock_key(name), name) == shard:
                    return name

        staying, leaving = on("a"), on("b")

        with AdvisoryLock(staying, config=t, wait=True, timeout=5) as held:
            assert held.acquired
        server.restart()
        with AdvisoryLock(leaving, config=t, wait=True, timeout=5) as held:
            assert held.acquired  # a session on the old map's DSN of shard a opened again
        waiting = AdvisoryLock(staying, config=t, wait=True, timeout=5)
        try:
            assert waiting.acquire()
        except LockTimeout:
            pytest.fail("the transition's wait waited on its own lock on the previous shard")
        try:
            assert not try_hold(AdvisoryLock(staying, config=o)), "an old-map holder beside it"
        finally:
            waiting.release()
    finally:
        registry.close()
        server.destroy()
