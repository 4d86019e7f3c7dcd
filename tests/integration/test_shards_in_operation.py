"""Shards in operation: guarded tables, holder(), `locks`, `key`, `guard` and `doctor`
across shards and during a change of the shards (a shard only the previous map names
included), a rule placing names on an added shard, a rule that raises, a shard down,
bad input, and passwords never shown (celery report too)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import psycopg
import pytest
from celery import Celery
from psycopg import sql as pgsql
from psycopg.conninfo import make_conninfo

from pglock_celery import AdvisoryLock, LockUnavailable, holder, install_guard
from pglock_celery.config import PglockConfig, load_config
from pglock_celery.exceptions import ConfigurationError, PglockError
from pglock_celery.guard import GUARD_SQLSTATE
from pglock_celery.keys import lock_key
from pglock_celery.rollout import Rollout
from pglock_celery.shards import parse_shards
from pglock_celery.sources import registry
from tests.support.services import free_port

SECRET = "pr0be-shard-secret"


@contextmanager
def probe_database(dsn: str) -> Iterator[str]:
    name = f"pglock_probe_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(pgsql.SQL("CREATE DATABASE {}").format(pgsql.Identifier(name)))
    try:
        yield make_conninfo(dsn, dbname=name)
    finally:
        registry.close()
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(
                pgsql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(pgsql.Identifier(name))
            )


@pytest.fixture(scope="module")
def three(pg_dsn: str) -> Iterator[dict[str, str]]:
    with probe_database(pg_dsn) as a, probe_database(pg_dsn) as b, probe_database(pg_dsn) as x:
        yield {"a": a, "b": b, "x": x}


@pytest.fixture(autouse=True)
def _close_sessions() -> Iterator[None]:
    yield
    registry.close()


def cfg(
    shards: dict[str, str], previous: dict[str, str] | None = None, **kw: object
) -> PglockConfig:
    return PglockConfig(
        shards=parse_shards(shards),
        shards_previous=parse_shards(previous) if previous else None,
        **kw,  # type: ignore[arg-type]
    )


def moving(before: PglockConfig, after: PglockConfig, to: str | None = None,
           frm: str | None = None, prefix: str = "probe:") -> str:  # fmt: skip
    for _ in range(20000):
        tenant = uuid.uuid4().hex[:10]
        name = f"{prefix}{tenant}"
        key = lock_key(name)
        old, new = before.shard_of(key, name), after.shard_of(key, name)
        if before.for_key(key, name).dsn == after.for_key(key, name).dsn:
            continue
        if (to is None or new == to) and (frm is None or old == frm):
            return name
    raise AssertionError("no moving name found")


@contextmanager
def record(dbs: dict[str, str], *configs: PglockConfig) -> Iterator[None]:
    """The record of the maps on ``dbs``, accepting exactly ``configs``' maps."""
    identities = [c.map_identity for c in configs]
    transition = next((i for i in identities if i is not None and i.transition), identities[0])
    assert transition is not None
    rollout = Rollout(list(dbs.items()), transition, lambda d: psycopg.connect(d, autocommit=True))
    rollout.accept(i.name for i in identities if i is not None)
    try:
        yield
    finally:
        registry.close()
        for dsn in dbs.values():
            with psycopg.connect(dsn, autocommit=True) as conn:
                conn.execute("DROP TABLE IF EXISTS pglock_shard_maps, pglock_shard_sessions")


def cli(env_extra: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PGLOCK_")}
    env.update(env_extra)
    return subprocess.run(
        [sys.executable, "-m", "pglock_celery.cli", "-A", "tests.apps.bare:app", *args],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip


# ---------------------------------------------------------------- secrets and bad input


def test_celery_report_masks_the_passwords_of_pglock_shards() -> None:
    from celery.app.utils import filter_hidden_settings

    app = Celery("probe-report", set_as_current=False)
    app.conf.update(
        pglock_shards={
            "a": f"host=127.0.0.1 dbname=x password={SECRET}",
            "b": {"dsn": f"postgresql://u:{SECRET}@127.0.0.1/x", "patroni_url": None},
        }
    )
    shown = app.conf.humanize(with_defaults=False, censored=True)
    censored = repr(filter_hidden_settings(app.conf.changes))
    assert SECRET not in shown and SECRET not in censored, (
        "celery report / inspect conf show the shard DSNs' passwords: Celery's censoring "
        "recurses into the pglock_shards mapping and masks by the inner keys ('a', 'dsn') "
        f"only; shown: {shown.strip()[:300]!r}"
    )


def test_a_shard_named_twice_in_PGLOCK_SHARDS_is_refused() -> None:
    raw = '{"a": "host=127.0.0.1 dbname=one", "a": "host=127.0.0.1 dbname=two"}'
    try:
        config = load_config(None, environ={"PGLOCK_SHARDS": raw})
    except ConfigurationError:
        return
    names = [s.name for s in config.shards or ()]
    raise AssertionError(
        f"PGLOCK_SHARDS naming shard 'a' twice was accepted silently (json keeps the last): "
        f"shards {names}, a's database is dbname=two; the first entry vanished"
    )


@pytest.mark.parametrize("raw", ["{}", "[]", "null", '{"a": ""}', '{"a": 5}', "{bad",
                                 '{"": "dbname=x"}', '{"a b": "dbname=x"}'])  # fmt: skip
def test_a_malformed_or_empty_PGLOCK_SHARDS_is_refused(raw: str) -> None:
    with pytest.raises(ConfigurationError):
        load_config(None, environ={"PGLOCK_SHARDS": raw})


def test_a_down_shard_fails_closed_for_its_names_only_and_never_shows_its_password(
    three: dict[str, str],
) -> None:
    port = free_port()
    forms = {
        "kv": make_conninfo(three["b"], host="127.0.0.1", port=str(port), password=SECRET),
        "uri": f"postgresql://probe:{SECRET}@127.0.0.1:{port}/nodb",
    }
    for form, down in forms.items():
        config = cfg({"a": three["a"], "b": down}, connect_timeout=2)
        on_b = next(
            n for n in (f"down:{uuid.uuid4().hex[:8]}" for _ in range(1000))
            if config.shard_of(lock_key(n), n) == "b"
        )  # fmt: skip
        with pytest.raises(LockUnavailable) as refused:
            AdvisoryLock(on_b, config=config).acquire()
        assert SECRET not in str(refused.value), (form, str(refused.value))
        on_a = next(
            n for n in (f"up:{uuid.uuid4().hex[:8]}" for _ in range(1000))
            if config.shard_of(lock_key(n), n) == "a"
        )  # fmt: skip
        with AdvisoryLock(on_a, config=config) as held:
            assert held.acquired, "a shard down kept another shard's name from locking"


# ---------------------------------------------------------------- shard_of and rules


def rule_to_b(name: str) -> str | None:
    return "b" if name.startswith("ruled:") else None


def rule_unknown(name: str) -> str | None:
    return "nowhere"


def rule_raises(name: str) -> str | None:
    raise KeyError(name)


def test_a_rule_naming_an_unknown_shard_is_refused_as_configuration(three: dict[str, str]) -> None:
    config = cfg({"a": three["a"], "b": three["b"]}, shard_rule=rule_unknown)
    with pytest.raises(ConfigurationError):
        config.shard_of(lock_key("t:1"), "t:1")
    with pytest.raises(ConfigurationError):
        AdvisoryLock("t:1", config=config)


def test_a_rule_that_raises_fails_closed_as_a_pglock_error(three: dict[str, str]) -> None:
    config = cfg({"a": three["a"], "b": three["b"]}, shard_rule=rule_raises)
    try:
        AdvisoryLock("t:1", config=config).acquire()
    except PglockError:
        return
    except Exception as exc:
        raise AssertionError(
            f"a rule that raises escapes as its own {type(exc).__name__}, not a PglockError "
            "(LockUnavailable/ConfigurationError): a task's autoretry_for=(LockUnavailable,) "
            "or a caller catching PglockError does not see it as a lock failure"
        ) from exc
    raise AssertionError("a lock was taken although its rule raised")


def test_a_rule_placed_name_can_move_to_a_new_shard_during_a_transition(
    three: dict[str, str],
) -> None:
    """Adding shard b and a rule that places 'ruled:' names there: the rule is the same
    for both maps (as the docs require), the transition locks such a name on its
    previous shard (by the hash, as before the shard existed: a) and then on b, and an
    old-map holder there keeps it out."""
    old = {"a": three["a"]}
    new = {"a": three["a"], "b": three["b"]}
    before, transition = cfg(old), cfg(new, old, shard_rule=rule_to_b)
    try:
        with record(three, before, transition):
            with AdvisoryLock("ruled:tenant-1", config=before) as old_holder:
                assert old_holder.acquired
                assert not AdvisoryLock("ruled:tenant-1", config=transition).acquire()
            lock = AdvisoryLock("ruled:tenant-1", config=transition)
            with lock:
                assert lock.acquired
    except ConfigurationError as exc:
        raise AssertionError(
            "a transition worker cannot lock a name its rule places on the new shard: the "
            "previous map is asked the same rule and refuses its answer, with the message "
            f"{exc} (which blames pglock_shards, although pglock_shards names b): a rule-placed "
            "tenant can never move to an added shard"
        ) from exc


# ---------------------------------------------------------------- holder() and the CLI


def test_holder_during_a_transition_names_the_old_map_holder_of_a_moving_name(
    three: dict[str, str],
) -> None:
    old = {"a": three["a"], "x": three["x"]}
    new = {"a": three["a"], "b": three["b"]}
    before, transition = cfg(old), cfg(new, old)
    name = moving(before, cfg(new))
    app = Celery("probe-holder", set_as_current=False)
    app.conf.update(pglock_shards=new, pglock_shards_previous=old)
    with record(three, before, transition), AdvisoryLock(name, config=before) as old_holder:
        assert old_holder.acquired
        rival = AdvisoryLock(name, config=transition)
        assert not rival.acquire(), "the transition took a name an old-map worker holds"
        assert rival.holder() is not None, "the refused lock's own holder() names nobody"
        from celery import _state

        was = _state.get_current_app()
        app.set_current()
        try:
            found = holder(name)
        finally:
            _state._set_current_app(was)
        assert found is not None, (
            f"holder({name!r}) under the transition's settings says the name is free, yet "
            "it cannot be taken: an old-map worker holds it on its previous shard, which "
            "holder() never asks (it asks only the new shard)"
        )


def test_locks_during_a_transition_lists_the_holders_on_a_previous_only_shard(
    three: dict[str, str],
) -> None:
    old = {"a": three["a"], "x": three["x"]}
    new = {"a": three["a"], "b": three["b"]}
    before = cfg(old)
    name = moving(before, cfg(new), frm="x", prefix="probe-locks:")
    env = {"PGLOCK_SHARDS": json.dumps(new), "PGLOCK_SHARDS_PREVIOUS": json.dumps(old)}
    with AdvisoryLock(name, config=before) as old_holder:
        assert old_holder.acquired
        done = cli(env, "locks", "--json", "--prefix", "probe-locks:")
        assert done.returncode == 0, done.stderr
        rows = json.loads(done.stdout)
        assert name in {row["name"] for row in rows}, (
            "during a change of the shards, `locks` lists only the new map's shards: the "
            f"old-map holder of {name!r} on shard x (which excludes every transition "
            f"worker from it) is invisible; rows: {rows}"
        )


def test_key_during_a_transition_says_a_moving_name_is_on_both_shards(
    three: dict[str, str],
) -> None:
    old = {"a": three["a"], "x": three["x"]}
    new = {"a": three["a"], "b": three["b"]}
    name = moving(cfg(old), cfg(new), frm="x", to="b")
    env = {"PGLOCK_SHARDS": json.dumps(new), "PGLOCK_SHARDS_PREVIOUS": json.dumps(old)}
    done = cli(env, "key", "-v", name)
    assert done.returncode == 0, done.stderr
    assert "x" in done.stdout.splitlines()[-1], (
        "`key -v` of a moving name during the transition says only "
        f"{done.stdout.splitlines()[-1]!r}:"
        " it is also locked (and its data still lives) on shard x of the previous map"
    )


def test_guard_install_and_doctor_during_a_transition_cover_a_previous_only_shard(
    three: dict[str, str],
) -> None:
    old = {"a": three["a"], "x": three["x"]}
    new = {"a": three["a"], "b": three["b"]}
    table = f"probe_guard_{uuid.uuid4().hex[:8]}"
    for dsn in three.values():
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(f"CREATE TABLE {table} (tenant_id text NOT NULL)")
    env = {"PGLOCK_SHARDS": json.dumps(new), "PGLOCK_SHARDS_PREVIOUS": json.dumps(old)}
    done = cli(env, "guard", "install", table, "--lock", "t:{tenant_id}")
    assert done.returncode == 0, done.stderr
    listed = json.loads(cli(env, "guard", "list", "--json").stdout)
    guarded = {row["shard"] for row in listed if row["table"].endswith(table)}
    doctor = cli(env, "doctor", "--json")
    checked = {f.get("shard") for f in json.loads(doctor.stdout)} if doctor.stdout else set()
    problems = []
    if "x" not in guarded:
        problems.append(
            f"`guard install` during the transition guarded {sorted(guarded)} only: shard x "
            "of the previous map, where the moving tenants' rows still live until step 4, "
            "is left unguarded (and `guard list` does not show it)"
        )
    if "x" not in checked:
        problems.append(
            f"`doctor` during the transition checks {sorted(s for s in checked if s)} only, "
            "not shard x, where old-map and transition workers still lock"
        )
    assert not problems, "; ".join(problems)


# ---------------------------------------------------------------- guarded tables


def _guarded(dsns: list[str], table: str) -> None:
    for dsn in dsns:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(f"CREATE TABLE {table} (tenant_id text NOT NULL, v int NOT NULL)")
            install_guard(conn, table, "t:{tenant_id}")


def test_guarded_writes_under_shards_need_the_lock_on_the_rows_shard(pg_dsn: str) -> None:
    # Databases of its own: sources made for other maps' configs in this process would
    # be handed to this steady map's (see the last test).
    with probe_database(pg_dsn) as a, probe_database(pg_dsn) as b:
        config = cfg({"a": a, "b": b})
        table = f"probe_g_{uuid.uuid4().hex[:8]}"
        _guarded([a, b], table)
        tenant = next(
            t for t in (uuid.uuid4().hex[:8] for _ in range(1000))
            if config.shard_of(lock_key(f"t:{t}"), f"t:{t}") == "b"
        )  # fmt: skip
        name = f"t:{tenant}"
        with AdvisoryLock(name, config=config) as held, held.transaction() as conn:
            conn.execute(f"INSERT INTO {table} VALUES (%s, 1)", (tenant,))
        with AdvisoryLock(name, config=config) as held:
            # The tenant's row written on the other shard, or on its own through a plain
            # session: refused by the guard.
            for dsn in (a, b):
                with psycopg.connect(dsn, autocommit=True) as other:
                    with pytest.raises(psycopg.Error) as refused:
                        other.execute(f"INSERT INTO {table} VALUES (%s, 1)", (tenant,))
                    assert refused.value.sqlstate == GUARD_SQLSTATE
        registry.close()


def _rows_split(three: dict[str, str], before: PglockConfig, transition: PglockConfig,
                table: str, name: str, tenant: str) -> None:  # fmt: skip
    with AdvisoryLock(name, config=before) as held, held.transaction() as conn:
        conn.execute(f"INSERT INTO {table} VALUES (%s, 1)", (tenant,))  # its row, on a
    # A transition worker (step 2) runs the tenant's step: it updates the row.
    with AdvisoryLock(name, config=transition) as held:
        assert held.acquired
        with held.transaction() as conn:
            updated = conn.execute(
                f"UPDATE {table} SET v = v + 1 WHERE tenant_id = %s", (tenant,)
            ).rowcount
            if updated == 0:
                conn.execute(f"INSERT INTO {table} VALUES (%s, 2)", (tenant,))
        # Where the row really is, no session the holder can reach may write it.
        with psycopg.connect(three["a"], autocommit=True) as plain:
            try:
                plain.execute(f"UPDATE {table} SET v = 99 WHERE tenant_id = %s", (tenant,))
                previous_writable = True
            except psycopg.Error:
                previous_writable = False
    # The old-map worker (still running before finish) runs the tenant's next step.
    with AdvisoryLock(name, config=before) as held, held.transaction() as conn:
        conn.execute(f"UPDATE {table} SET v = v + 1 WHERE tenant_id = %s", (tenant,))
    rows = {}
    for shard in ("a", "b"):
        with psycopg.connect(three[shard], autocommit=True) as conn:
            rows[shard] = conn.execute(
                f"SELECT v FROM {table} WHERE tenant_id = %s", (tenant,)
            ).fetchall()
    assert updated == 1 and not rows["b"], (
        "during the transition, the transition holder's lock.connection is on the new shard "
        f"b where the tenant's rows are not (UPDATE matched {updated} rows; the row on a was "
        f"{'writable' if previous_writable else 'refused by the guard'} from a plain session), "
        "so its guarded write lands on b while old-map holders keep writing a: the tenant's "
        f"rows split over two databases, every write accepted by the guards: {rows}"
    )


# ---------------------------------------------------------------- one process, two maps


@pytest.mark.parametrize("strategy", ["reuse", "connect"])
def test_an_old_map_lock_is_refused_after_finish_in_a_process_that_ran_the_transition(
    pg_dsn: str, strategy: str
) -> None:
    """After finish (the record accepts the transition and the new map, not the old):
    the old map's lock sessions must be refused, whatever else this process ran."""
    with probe_database(pg_dsn) as a, probe_database(pg_dsn) as b:
        old, new = {"a": a}, {"a": a, "b": b}
        before = cfg(old, strategy=strategy)
        transition = cfg(new, old, strategy=strategy)
        after = cfg(new, strategy=strategy)
        with record({"a": a, "b": b}, transition, after):
            # Without the transition having run here, the old map is refused.
            name = moving(before, cfg(new), to="b", prefix="fence:")
            # The transition's worker code ran once in this process (a staying name).
            staying = next(
                n for n in (f"stay:{uuid.uuid4().hex[:8]}" for _ in range(1000))
                if transition.previous_for_key(lock_key(n), n) is None
            )  # fmt: skip
            with AdvisoryLock(staying, config=transition) as held:
                assert held.acquired
            new_holder = AdvisoryLock(name, config=after)
            old_holder = AdvisoryLock(name, config=before)
            try:
                assert new_holder.acquire(), "the new map's worker could not lock after finish"
                try:
                    took = old_holder.acquire()
                except LockUnavailable:
                    took = False
                assert not took, (
                    f"after finish, an old-map lock of {name!r} was granted on shard a while a "
                    "new-map worker holds it on b (two holders): the registry keys sources by "
                    "PglockConfig equality, which ignores the map identity, so the old map's "
                    "shard config got the transition's source, whose sessions record the "
                    "transition's map"
                )
            finally:
                old_holder.release()
                new_holder.release()
