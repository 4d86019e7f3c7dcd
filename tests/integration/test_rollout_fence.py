"""The fence of a change of the shards at its edges (docs/shards.md, "Changing the shards").

Each test drives real Postgres databases of its own (pglock_rollout_*, make_dbs) with
in-process AdvisoryLock objects of the old map, the transition and the new map (distinct
application_name prefixes, as test_shard_rollout.py does), and the operator's steps as
`pglock-celery shards` builds them (tests/support/rollout.py):
DSNs that name one database in two ways or two databases by a service, sessions that
predate the record under any name, a step run while another waits, a role without
schema public.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Callable
from pathlib import Path

import psycopg
import pytest
from psycopg import sql as psql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from pglock_celery import LockTimeout, LockUnavailable
from pglock_celery.config import PglockConfig
from pglock_celery.lock import AdvisoryLock
from pglock_celery.rollout import RolloutRefused
from pglock_celery.shards import parse_shards
from pglock_celery.sources import registry
from tests.support.rollout import configs, moving_name, operator

# -- databases of the tests' own --------------------------------------------------


def both_held(first: AdvisoryLock, second: AdvisoryLock) -> bool:
    """Acquire ``first`` then try ``second``: whether both were held at once (then
    both are released)."""
    try:
        if not first.acquire():
            return False
        try:
            got = second.acquire()
        except LockUnavailable:
            return False
        if got:
            second.release()
        return got
    finally:
        with contextlib.suppress(Exception):
            first.release()


# -- what tells maps apart -----------------------------------------------------------


def test_a_shard_moved_between_services_is_a_change_the_fence_sees(
    make_dbs: Callable[[int], list[str]], clean_env: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A shard given as `service=NAME` (pg_service.conf) moves to another service, i.e.
    another database: the service is part of the map's identity, so the new map is
    refused while the old one holds, and both databases get the record."""
    one, two = make_dbs(2)
    p1, p2 = conninfo_to_dict(one), conninfo_to_dict(two)
    services = tmp_path / "pg_service.conf"
    services.write_text(
        "".join(
            f"[{svc}]\nhost={p['host']}\nport={p.get('port', 5432)}\nuser={p.get('user', '')}\n"
            f"dbname={p['dbname']}\n\n"
            for svc, p in (("pglock_attack_one", p1), ("pglock_attack_two", p2))
        )
    )
    clean_env.setenv("PGSERVICEFILE", str(services))
    old = {"a": "service=pglock_attack_one"}
    new = {"a": "service=pglock_attack_two"}
    name = "tenant:moving"  # one shard each: every name moves
    o, _, n = configs(old, new)
    try:
        operator(clean_env, old).init()
        operator(clean_env, new, old).begin()
        registry.close()
        # After begin a new-map worker must be refused while an old-map one holds.
        assert not both_held(AdvisoryLock(name, config=o), AdvisoryLock(name, config=n)), (
            "an old-map and a new-map holder of one name at once: identities "
            f"old={o.map_identity.name} new={n.map_identity.name}"
        )
    finally:
        registry.close()


# -- sessions opened before the record ------------------------------------------------


def test_a_session_opened_before_the_record_under_another_prefix_holds_finish_back(
    make_dbs: Callable[[int], list[str]], clean_env: pytest.MonkeyPatch
) -> None:
    """An old-map worker whose pglock_application_name is not the operator's (here
    "worker") keeps a reuse idle session opened before `begin` created the record: it
    recorded no map, but its name is a lock session's, so finish waits for it."""
    a, b, c = make_dbs(3)
    old, new = {"a": a, "b": b}, {"a": a, "b": b, "c": c}
    name = moving_name(old, new)
    o = PglockConfig(shards=parse_shards(old), application_name="worker")
    _, _, n = configs(old, new)
    try:
        with AdvisoryLock(name, config=o) as held:  # opened before any record
            assert held.acquired
        rollout = operator(clean_env, new, old)
        rollout.begin()
        _, left = rollout.finish(1.0, lambda _: None)
        # What finish let happen: both hold the moving name.
        both = both_held(AdvisoryLock(name, config=o), AdvisoryLock(name, config=n))
    finally:
        registry.close()
    assert left and not both, f"finish left {left}; an old-map and a new-map holder at once: {both}"


def test_a_holder_that_renames_its_session_hides_it_from_finish(
    make_dbs: Callable[[int], list[str]], clean_env: pytest.MonkeyPatch
) -> None:
    """A session opened before the record, renamed by its holder (`SET
    application_name` on lock.connection), is still known by the lock it holds."""
    a, b, c = make_dbs(3)
    old, new = {"a": a, "b": b}, {"a": a, "b": b, "c": c}
    name = moving_name(old, new)
    o, _, n = configs(old, new)
    try:
        # Open the old map's session before the record (reuse: it stays idle).
        with AdvisoryLock(name, config=o):
            pass
        rollout = operator(clean_env, new, old)
        rollout.begin()
        with AdvisoryLock(name, config=o) as held:
            assert held.acquired
            held.connection.execute("SET application_name = 'nightly report'")
            _, left = rollout.finish(1.0, lambda _: None)
            newer = AdvisoryLock(name, config=n)
            try:
                got = newer.acquire()
            except LockUnavailable:
                got = False
            if got:
                newer.release()
        assert not got, f"new-map holder while an old-map one held (finish left {left})"
    finally:
        registry.close()


# -- a step run while finish waits ------------------------------------------------------


def test_a_begin_run_while_finish_drains_cannot_let_the_old_map_back_in(
    make_dbs: Callable[[int], list[str]], clean_env: pytest.MonkeyPatch
) -> None:
    """Another operator's (or a deploy script's) `begin` while finish drains: the old map
    is accepted again and an old-map worker locks. finish looks again under the
    record's write lock before it accepts the new map: it sees the old one back and
    refuses, writing nothing, and the new map stays refused."""
    a, b, c = make_dbs(3)
    old, new = {"a": a, "b": b}, {"a": a, "b": b, "c": c}
    name = moving_name(old, new)
    o, _, n = configs(old, new)
    finishing = operator(clean_env, new, old)
    other = operator(clean_env, new, old)
    finishing.begin()
    old_holder = AdvisoryLock(name, config=o)
    drained = finishing.drain

    def drain_then_race(*args: object, **kwargs: object) -> object:
        left = drained(*args, **kwargs)  # type: ignore[arg-type]
        other.begin()  # the second operator's begin: allowed, it is this change's
        assert old_holder.acquire(), "old-map worker refused after the second begin"
        return left

    finishing.drain = drain_then_race  # type: ignore[method-assign]
    try:
        with pytest.raises(RolloutRefused, match="meanwhile"):
            finishing.finish(5.0, lambda _: None)
        assert old_holder.acquired
        with pytest.raises(LockUnavailable, match="not accepted"):
            AdvisoryLock(name, config=n).acquire()
    finally:
        with contextlib.suppress(Exception):
            old_holder.release()
        registry.close()


# -- a shard's DSN changed, its database the same ------------------------------------


@pytest.mark.parametrize("strategy", ["reuse", "connect", "shared"])
def test_a_transition_worker_can_lock_a_name_whose_database_did_not_change(
    make_dbs: Callable[[int], list[str]], clean_env: pytest.MonkeyPatch, strategy: str
) -> None:
    """Shard a's DSN changes from host=127.0.0.1 to host=localhost: the same database.
    The transition's sessions find that both DSNs reach one database and take the name
    once: taken twice from two sessions, the second would wait on the first (a try
    refused for ever, an untimed wait for ever on itself)."""
    (a,) = make_dbs(1)
    params = conninfo_to_dict(a)
    assert params["host"] == "127.0.0.1", "this test needs the server on 127.0.0.1"
    old = {"a": a}
    new = {"a": make_conninfo(a, host="localhost")}
    o, t, _ = configs(old, new, strategy=strategy)
    try:
        operator(clean_env, old).init()
        operator(clean_env, new, old).begin()
        lock = AdvisoryLock("tenant:x", config=t)
        try:
            assert lock.acquire(), "the transition was refused a name nobody holds"
            assert not AdvisoryLock("tenant:x", config=o).acquire(), "two holders"
        finally:
            with contextlib.suppress(Exception):
                lock.release()
        waiting = AdvisoryLock("tenant:x", config=t, wait=True, timeout=2)
        try:
            waiting.acquire()
        except LockTimeout:
            pytest.fail("a wait_lock of the transition waits on itself (for ever, untimed)")
        finally:
            with contextlib.suppress(Exception):
                waiting.release()
    finally:
        registry.close()


# -- a role that may not use schema public ---------------------------------------------


def test_a_role_without_usage_on_public_still_locks_where_no_record_is_kept(
    make_dbs: Callable[[int], list[str]], pg_dsn: str
) -> None:
    """Without a record every map is accepted, as before: a role without USAGE on schema
    public (a hardened database) still locks; whether the record exists is read from
    the catalog."""
    (d,) = make_dbs(1)
    role = f"pglock_attack_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(d, autocommit=True) as conn:
        conn.execute(psql.SQL("CREATE ROLE {} LOGIN").format(psql.Identifier(role)))
        conn.execute("REVOKE ALL ON SCHEMA public FROM PUBLIC")
    try:
        config = PglockConfig(dsn=make_conninfo(d, user=role))
        with AdvisoryLock("tenant:x", config=config) as held:
            assert held.acquired
    finally:
        registry.close()
        with psycopg.connect(d, autocommit=True) as conn:
            conn.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s",
                (role,),
            )
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            with contextlib.suppress(psycopg.Error):
                conn.execute(psql.SQL("DROP ROLE {}").format(psql.Identifier(role)))


# -- the steps themselves -------------------------------------------------------------


@pytest.mark.parametrize("strategy", ["reuse", "connect", "shared"])
def test_a_new_map_session_opened_during_finish_is_refused(
    make_dbs: Callable[[int], list[str]], clean_env: pytest.MonkeyPatch, strategy: str
) -> None:
    a, b, c = make_dbs(3)
    old, new = {"a": a, "b": b}, {"a": a, "b": b, "c": c}
    name = moving_name(old, new)
    o, t, n = configs(old, new, strategy=strategy)
    rollout = operator(clean_env, new, old)
    calls: list[object] = []
    try:
        rollout.begin()
        with AdvisoryLock(name, config=o) as held:
            assert held.acquired
            drained = rollout.drain

            def drain_and_try(*args: object, **kwargs: object) -> object:
                # Inside finish: the transition alone is accepted.
                with pytest.raises(LockUnavailable, match="not accepted"):
                    AdvisoryLock(name, config=n).acquire()
                with pytest.raises(LockUnavailable, match="not accepted"):
                    AdvisoryLock("tenant:other-" + name, config=o).acquire()
                calls.append(1)
                return drained(*args, **kwargs)  # type: ignore[arg-type]

            rollout.drain = drain_and_try  # type: ignore[method-assign]
            _, left = rollout.finish(0.5, lambda _: None)
            assert left and calls
            assert not AdvisoryLock(name, config=t).acquire()
    finally:
        registry.close()


def test_finish_twice_and_begin_after_finish_change_nothing(
    make_dbs: Callable[[int], list[str]], clean_env: pytest.MonkeyPatch
) -> None:
    a, b, c = make_dbs(3)
    old, new = {"a": a, "b": b}, {"a": a, "b": b, "c": c}
    rollout = operator(clean_env, new, old)
    rollout.begin()
    assert rollout.finish(5, lambda _: None) == (False, {})
    accepted = rollout.accepted()
    assert rollout.finish(5, lambda _: None) == (True, {})
    with pytest.raises(RolloutRefused):
        rollout.begin()
    with pytest.raises(RolloutRefused):
        operator(clean_env, old).init()
    assert rollout.accepted() == accepted


def test_a_refused_map_is_told_without_the_password(
    make_dbs: Callable[[int], list[str]], clean_env: pytest.MonkeyPatch
) -> None:
    a, b, c = make_dbs(3)
    secret = "s3cr3t-attack-pw"
    old = {"a": a, "b": b}
    new = {s: make_conninfo(d, password=secret) for s, d in {"a": a, "b": b, "c": c}.items()}
    name = moving_name(old, new)
    try:
        operator(clean_env, new, old).begin()
        _, _, n = configs(old, new)
        with pytest.raises(LockUnavailable) as refused:
            AdvisoryLock(name, config=n).acquire()
        assert secret not in str(refused.value)
        assert secret not in repr(n.map_identity)
    finally:
        registry.close()


def test_a_step_by_a_role_that_cannot_see_every_session_writes_nothing(
    make_dbs: Callable[[int], list[str]], clean_env: pytest.MonkeyPatch, pg_dsn: str
) -> None:
    """Other roles' sessions show such a role no start: it is refused before it writes,
    and the rows of live sessions stay (none is taken for gone)."""
    a, b, c = make_dbs(3)
    old, new = {"a": a, "b": b}, {"a": a, "b": b, "c": c}
    name = moving_name(old, new)
    o, _, _ = configs(old, new)
    role = f"pglock_attack_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(psql.SQL("CREATE ROLE {} LOGIN").format(psql.Identifier(role)))
    try:
        operator(clean_env, old).init()
        with AdvisoryLock(name, config=o) as held:
            assert held.acquired
            where = held.config.require_dsn()
            before = operator(clean_env, new, old).accepted()
            as_role = {s: make_conninfo(d, user=role) for s, d in new.items()}
            previous = {s: as_role[s] for s in old}
            with pytest.raises(RolloutRefused, match="pg_read_all_stats"):
                operator(clean_env, as_role, previous).begin()
            assert operator(clean_env, new, old).accepted() == before
            with psycopg.connect(where, autocommit=True) as conn:
                rows = conn.execute(
                    "SELECT count(*) FROM public.pglock_shard_sessions WHERE pid = %s",
                    (held.connection.info.backend_pid,),
                ).fetchone()
            assert rows == (1,), "a live session's row was taken for gone"
    finally:
        registry.close()
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute(psql.SQL("DROP ROLE IF EXISTS {}").format(psql.Identifier(role)))


def test_no_role_rewrites_or_deletes_another_live_sessions_record_not_even_its_owner(
    make_dbs: Callable[[int], list[str]], clean_env: pytest.MonkeyPatch, pg_dsn: str
) -> None:
    """A session that relabelled another's map (or deleted its row) would hide it from
    finish: rows are a session's own to write, and deleted only once it is gone."""
    a, b = make_dbs(2)
    old = {"a": a, "b": b}
    o = PglockConfig(shards=parse_shards(old), application_name="pglock-old")
    role = f"pglock_attack_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(psql.SQL("CREATE ROLE {} LOGIN").format(psql.Identifier(role)))
    try:
        operator(clean_env, old).init()
        with AdvisoryLock("tenant:kept", config=o) as held:
            assert held.acquired
            where, pid = held.config.require_dsn(), held.connection.info.backend_pid
            with psycopg.connect(where, autocommit=True) as conn:
                conn.execute(
                    psql.SQL("GRANT USAGE ON SCHEMA public TO {}").format(psql.Identifier(role))
                )
            as_role = make_conninfo(where, user=role)

            def tamper() -> list[tuple[object, ...]]:
                with psycopg.connect(as_role, autocommit=True) as conn:
                    conn.execute(
                        "UPDATE public.pglock_shard_sessions SET map = 'hidden' WHERE pid = %s",
                        (pid,),
                    )
                    with contextlib.suppress(psycopg.errors.InsufficientPrivilege):
                        conn.execute(
                            "DELETE FROM public.pglock_shard_sessions WHERE pid = %s", (pid,)
                        )
                with psycopg.connect(where, autocommit=True) as conn:
                    return conn.execute(
                        "SELECT map FROM public.pglock_shard_sessions WHERE pid = %s", (pid,)
                    ).fetchall()

            recorded = [(o.map_identity.name,)] if o.map_identity else []
            assert tamper() == recorded, "another role rewrote a live session's record"
            with psycopg.connect(where, autocommit=True) as conn:
                conn.execute(
                    psql.SQL("ALTER TABLE public.pglock_shard_sessions OWNER TO {}").format(
                        psql.Identifier(role)
                    )
                )
            assert tamper() == recorded, "the table's owner rewrote a live session's record"
    finally:
        registry.close()
        for dsn in (a, b):
            with psycopg.connect(dsn, autocommit=True) as conn:
                conn.execute(psql.SQL("DROP OWNED BY {}").format(psql.Identifier(role)))
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute(psql.SQL("DROP ROLE IF EXISTS {}").format(psql.Identifier(role)))
