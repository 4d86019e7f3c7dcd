"""The command line across shards: locks, key, guard and doctor on every shard of
pglock_shards (or the one --shard names), each line or row naming its shard."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator

import psycopg
import pytest
from psycopg.conninfo import make_conninfo

from pglock_celery import AdvisoryLock
from pglock_celery.config import PglockConfig
from pglock_celery.keys import lock_key
from pglock_celery.shards import parse_shards
from tests.support.services import own_database

#: Shown nowhere, whatever a command prints (the server trusts the test's logins).
SECRET = "s3cret-shard-pw"


@pytest.fixture(scope="module")
def three(pg_dsn: str) -> Iterator[dict[str, str]]:
    with own_database(pg_dsn) as a, own_database(pg_dsn) as b, own_database(pg_dsn) as c:
        yield {
            name: make_conninfo(dsn, password=SECRET)
            for name, dsn in zip("abc", (a, b, c), strict=True)
        }


def cli(shards: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PGLOCK_")}
    env["PGLOCK_SHARDS"] = json.dumps(shards)
    # An app of its own (-A): the default Celery app would read the orchestrator's
    # celeryconfig.py, on the path of this checkout, with its pglock_dsn.
    done = subprocess.run(
        [sys.executable, "-m", "pglock_celery.cli", "-A", "tests.apps.bare:app", *args],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert SECRET not in done.stdout + done.stderr
    return done


def one_lock_per_shard(three: dict[str, str]) -> dict[str, AdvisoryLock]:
    config = PglockConfig(shards=parse_shards(three))
    held: dict[str, AdvisoryLock] = {}
    while len(held) < len(three):
        name = f"cli-shards:{uuid.uuid4().hex[:8]}"
        shard = config.shard_of(lock_key(name), name)
        if shard not in held:
            held[shard] = AdvisoryLock(name, config=config)
            assert held[shard].acquire()
    return held


def test_locks_lists_every_shards_locks_each_with_its_shard(three: dict[str, str]) -> None:
    held = one_lock_per_shard(three)
    try:
        done = cli(three, "locks", "--json", "--prefix", "cli-shards:")
        assert done.returncode == 0, done.stderr
        rows = json.loads(done.stdout)
        assert {(row["shard"], row["name"]) for row in rows} == {
            (shard, lock.name) for shard, lock in held.items()
        }
        table = cli(three, "locks", "--prefix", "cli-shards:")
        assert table.stdout.splitlines()[0].split()[0] == "SHARD"
        assert table.stdout.splitlines()[-1] == "3 advisory lock(s) held on 3 shards"
        only_b = json.loads(cli(three, "locks", "--json", "--shard", "b").stdout)
        assert {row["shard"] for row in only_b} == {"b"}
        assert held["b"].name in {row["name"] for row in only_b}
    finally:
        for lock in held.values():
            lock.release()


def test_key_says_which_shard_a_name_lives_on(three: dict[str, str]) -> None:
    config = PglockConfig(shards=parse_shards(three))
    name = "tenant:42"
    done = cli(three, "key", "-v", name)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == str(lock_key(name))
    assert lines[-1] == f"shard: {config.shard_of(lock_key(name), name)}"


def test_guard_installs_lists_and_removes_on_every_shard(three: dict[str, str]) -> None:
    table = f"cli_shard_{uuid.uuid4().hex[:8]}"
    for dsn in three.values():
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(f"CREATE TABLE {table} (tenant_id text NOT NULL)")
    installed = cli(three, "guard", "install", table, "--lock", "t:{tenant_id}")
    assert installed.returncode == 0, installed.stderr
    assert installed.stdout.count(f"guarded {table}") == 3
    listed = json.loads(cli(three, "guard", "list", "--json").stdout)
    assert {row["shard"] for row in listed if row["table"].endswith(table)} == {"a", "b", "c"}
    removed = cli(three, "guard", "remove", table, "--shard", "c")
    assert removed.returncode == 0 and removed.stdout.startswith("shard c (")
    left = json.loads(cli(three, "guard", "list", "--json").stdout)
    assert {row["shard"] for row in left if row["table"].endswith(table)} == {"a", "b"}


def test_doctor_checks_every_shard_and_names_it_in_each_finding(three: dict[str, str]) -> None:
    done = cli(three, "doctor", "--json")
    assert done.returncode in (0, 1), done.stderr
    findings = json.loads(done.stdout)
    assert {f["shard"] for f in findings} == {"a", "b", "c"}
    for shard in "abc":
        checks = {f["check"] for f in findings if f["shard"] == shard}
        assert {"capacity", "lock session", "settings"} <= checks, (shard, checks)
    text = cli(three, "doctor").stdout
    assert [line.split(" (")[0] for line in text.splitlines() if line.startswith("shard ")] == [
        "shard a", "shard b", "shard c"
    ]  # fmt: skip


def test_an_unknown_shard_is_bad_input_naming_the_shards(three: dict[str, str]) -> None:
    done = cli(three, "locks", "--shard", "z")
    assert done.returncode == 2
    assert done.stderr.strip() == ("pglock-celery: error: --shard 'z': pglock_shards names a, b, c")
