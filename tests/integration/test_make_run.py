"""`make run` as a user runs it: contention shows as skips, a broken start fails the run,
and it works in a Postgres and a Redis database of its own, installing only the demo's
packages."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
import redis
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from pglock_celery import lock_key
from pglock_celery.config import PglockConfig
from pglock_celery.shards import parse_shards
from tasks import fleet
from tasks.celery_app import app as tasks_app
from tasks.pipeline import skip_keys
from tasks.run import OWNER_MARK, REDIS_MARK_KEY, Fleet, FlowerSite, schema_dsn, wait_until_up
from tests.support.rabbitmq import delete_queues, rabbitmq_for_tests
from tests.support.services import free_port

ROOT = Path(__file__).resolve().parents[2]


def database_of(dsn: str) -> str:
    return str(conninfo_to_dict(dsn)["dbname"])


@pytest.fixture
def schema(pg_dsn: str, broker_url: str) -> Iterator[str]:
    """A schema (and queue) of the test's own, dropped afterwards with its skip counters."""
    name = f"orch_run_{uuid.uuid4().hex[:8]}"
    yield name
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(f"DROP SCHEMA IF EXISTS {name} CASCADE")
    redis.Redis.from_url(broker_url).delete(*skip_keys(f"pipelines-{name}"))


def make_run(args: str, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["make", "--no-print-directory", "run", f"ARGS={args}"],
        cwd=ROOT, env={**os.environ, **env}, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


def figure(name: str, stdout: str) -> int:
    """A number of the summary: `skips   12 (...)` -> 12."""
    found = re.search(rf"^  {name}\s+(\d+)", stdout, re.MULTILINE)
    assert found, f"no {name!r} in the summary:\n{stdout[-3000:]}"
    return int(found[1])


def assert_healthy_with_skips(done: subprocess.CompletedProcess[str]) -> None:
    print(done.stdout[-1500:])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert figure("skips", done.stdout) > 0, "no step ever found its tenant locked"
    assert figure("overlapping steps", done.stdout) == 0
    assert figure("duplicate jobs", done.stdout) == 0
    assert figure("repeated submits", done.stdout) == 0
    assert "result: OK" in done.stdout
    # Flower's address and credentials come once it serves, before the first status line.
    flower = re.search(
        r"^Flower: (http://127\.0\.0\.1:\d+/) \(user (\S+), password (\S+)\)", done.stdout, re.M
    )
    assert flower, done.stdout[:2000]
    assert done.stdout.index("Flower: ") < done.stdout.index("] cycles ")


def test_a_fast_30_second_run_skips_and_never_overlaps(
    pg_dsn: str, broker_url: str, schema: str
) -> None:
    """The README's `make run ARGS="--fast --duration 30 --plain"`, on the tests' services."""
    args = (
        f"--fast --duration 30 --plain --schema {schema} --database {database_of(pg_dsn)}"
        f" --flower-port {free_port()}"
    )
    done = make_run(args, {"PGLOCK_DSN": pg_dsn, "ORCH_BROKER_URL": broker_url}, 180)
    assert_healthy_with_skips(done)
    # Skips per replica: every replica's count is in the summary.
    assert re.search(r"replica1 \d+, replica2 \d+, replica3 \d+", done.stdout)


def test_a_run_with_flowers_port_taken_fails_naming_the_port(
    pg_dsn: str, broker_url: str, schema: str
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        args = (
            f"--fast --duration 30 --plain --schema {schema} --database {database_of(pg_dsn)}"
            f" --flower-port {port}"
        )
        done = make_run(args, {"PGLOCK_DSN": pg_dsn, "ORCH_BROKER_URL": broker_url}, 60)
    print(done.stderr)
    assert done.returncode != 0
    assert f"port {port}" in done.stderr and "--flower-port" in done.stderr
    assert "result: OK" not in done.stdout


def test_a_component_that_exits_at_start_is_reported(tmp_path: Path) -> None:
    """A beat that dies on start and a Flower that never serves: both named, with the cause."""
    env = {"PGLOCK_DSN": "unused"}
    dying = fleet.Process(
        "beat1", [sys.executable, "-c", "print('schedule file is locked'); raise SystemExit(3)"],
        env, tmp_path,
    )  # fmt: skip
    silent = fleet.Process(
        "flower", [sys.executable, "-c", "import time; time.sleep(60)"], env, tmp_path
    )
    crew = Fleet(replicas=[], beats=[dying], flower=silent)
    for process in (dying, silent):
        process.start()
    try:
        failures = wait_until_up(
            crew, tasks_app, FlowerSite(f"http://127.0.0.1:{free_port()}/", "u", "p")
        )
    finally:
        crew.stop()
    assert len(failures) == 1, failures
    assert failures[0].startswith("beat1 exited with status 3: schedule file is locked")


def test_make_run_on_rabbitmq(
    pg_dsn: str, broker_url: str, schema: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """`--broker amqp://...`: steps go through RabbitMQ; results and counters stay on Redis."""
    with rabbitmq_for_tests(tmp_path_factory.mktemp("rabbitmq")) as amqp:
        args = (
            f"--fast --duration 20 --plain --schema {schema} --database {database_of(pg_dsn)}"
            f" --flower-port {free_port()} --broker {amqp}"
        )
        try:
            done = make_run(args, {"PGLOCK_DSN": pg_dsn, "ORCH_BROKER_URL": broker_url}, 180)
        finally:
            delete_queues(amqp, f"pipelines-{schema}")
    assert_healthy_with_skips(done)
    assert re.search(r"broker amqp://guest:\*\*\*\*@", done.stdout), done.stdout[:500]


def test_make_run_installs_only_the_demos_packages() -> None:
    """The run target's install: the demo's extras, no test tools, no apt packages."""
    plan = subprocess.run(
        ["make", "--no-print-directory", "-n", "-W", "pyproject.toml", "run"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    installs = [line for line in plan.splitlines() if "pip install" in line]
    assert installs, plan
    assert all(".[redis,binary,run]'" in line for line in installs), installs
    assert "test" not in "".join(installs) and "apt-get" not in plan, plan


@pytest.fixture
def demo_database(pg_server: str) -> Iterator[str]:
    """A name for the run's own database (the run creates it, or with --shards 3 its
    NAME_s1 to NAME_s3); dropped afterwards."""
    name = f"pglock_demo_{uuid.uuid4().hex[:8]}"
    yield name
    with psycopg.connect(pg_server, autocommit=True) as conn:
        for database in (name, *(f"{name}_s{n}" for n in (1, 2, 3))):
            conn.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(database))
            )


def test_a_run_works_in_databases_of_its_own(
    pg_server: str, demo_database: str, schema: str, redis_server: str
) -> None:
    """Given only a server, the run creates its database there and takes a Redis db but 0."""
    env = {"PGLOCK_DSN": pg_server, "ORCH_BROKER_URL": "", "ORCH_RESULT_BACKEND": ""}
    args = (
        f"--fast --duration 8 --plain --tenants 4 --replicas 1 --schema {schema}"
        f" --database {demo_database} --flower-port {free_port()}"
    )
    done = make_run(args, env, 180)
    print(done.stdout[-1500:], done.stderr[-1500:])
    found = re.search(r"results (redis://\S+/(\d+)),", done.stdout)
    assert found, done.stdout[:2000]
    results, db = found[1], int(found[2])
    try:
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        assert f"created the database {demo_database}" in done.stdout
        assert db != 0
        with psycopg.connect(pg_server, autocommit=True) as conn:
            comment = conn.execute(
                "SELECT shobj_description(oid, 'pg_database') FROM pg_database WHERE datname = %s",
                (demo_database,),
            ).fetchone()
            in_server_db = conn.execute(
                "SELECT 1 FROM pg_namespace WHERE nspname = %s", (schema,)
            ).fetchone()
        assert comment == (OWNER_MARK,)
        assert in_server_db is None, "the run made its schema in the server's own database"
        with psycopg.connect(make_conninfo(pg_server, dbname=demo_database)) as conn:
            tenants = conn.execute(
                sql.SQL("SELECT count(*) FROM {}.tenants").format(sql.Identifier(schema))
            ).fetchone()
        assert tenants == (4,)
        if redis_server.startswith("redis://127.0.0.1:6379"):  # the same server as the run's
            zero = redis.Redis.from_url(redis_server.rsplit("/", 1)[0] + "/0")
            assert not zero.exists(*skip_keys(f"pipelines-{schema}"))
            assert redis.Redis.from_url(results).get(REDIS_MARK_KEY) == b"make run"
    finally:
        own = redis.Redis.from_url(results)
        own.delete(*skip_keys(f"pipelines-{schema}"))
        for key in own.scan_iter(f"*pipelines-{schema}*"):
            own.delete(key)


def test_a_schema_the_run_did_not_make_is_never_dropped(pg_dsn: str, broker_url: str) -> None:
    """A schema of the same name made by someone else: the run stops, the schema stays."""
    name = f"users_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(name)))
        conn.execute(sql.SQL("CREATE TABLE {}.keep (x int)").format(sql.Identifier(name)))
        conn.execute(sql.SQL("INSERT INTO {}.keep VALUES (42)").format(sql.Identifier(name)))
    try:
        args = (
            f"--fast --duration 5 --plain --schema {name} --database {database_of(pg_dsn)}"
            f" --flower-port {free_port()}"
        )
        done = make_run(args, {"PGLOCK_DSN": pg_dsn, "ORCH_BROKER_URL": broker_url}, 120)
        print(done.stderr)
        assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
        assert f"the schema {name}" in done.stderr and "not made by make run" in done.stderr
        with psycopg.connect(pg_dsn) as conn:
            kept = conn.execute(
                sql.SQL("SELECT x FROM {}.keep").format(sql.Identifier(name))
            ).fetchall()
        assert kept == [(42,)]
    finally:
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(name)))


def test_a_run_over_three_shards_keeps_each_tenant_on_its_locks_shard(
    pg_server: str, demo_database: str, schema: str, broker_url: str
) -> None:
    """`--shards 3`: three databases of the run's own, each tenant's rows in the one its lock
    lives on, steps on every shard, and the same zero-overlap report."""
    args = (
        f"--fast --duration 20 --plain --shards 3 --schema {schema} --database {demo_database}"
        f" --flower-port {free_port()}"
    )
    done = make_run(args, {"PGLOCK_DSN": pg_server, "ORCH_BROKER_URL": broker_url}, 240)
    assert_healthy_with_skips(done)
    shards = {
        f"s{n}": schema_dsn(make_conninfo(pg_server, dbname=f"{demo_database}_s{n}"), schema)
        for n in (1, 2, 3)
    }
    placement = PglockConfig(shards=parse_shards(shards))
    found: dict[str, list[str]] = {}  # tenant -> the shards whose database has its rows
    for shard, dsn in shards.items():
        with psycopg.connect(dsn) as conn:
            for table in ("tenants", "pipelines", "step_history", "training_jobs"):
                tenants = conn.execute(f"SELECT DISTINCT tenant_id FROM {table}").fetchall()
                for (tenant,) in tenants:
                    if shard not in found.setdefault(tenant, []):
                        found[tenant].append(shard)
            steps = conn.execute("SELECT count(*) FROM step_history").fetchone()
        assert steps is not None and steps[0] > 0, f"no step ran on shard {shard}"
        # The report's line on the shard: `s1: 7 tenants, 119 steps`.
        assert re.search(rf"\b{shard}: [1-9]\d* tenants, [1-9]\d* steps", done.stdout), shard
    assert sorted(found) == [f"tenant-{n:03d}" for n in range(1, 21)]
    for tenant, where in found.items():
        name = f"training:{tenant}"
        assert where == [placement.shard_of(lock_key(name), name)], (tenant, where)
    assert {where[0] for where in found.values()} == set(shards)
    assert figure("shards", done.stdout) == 3
    assert figure("tenants", done.stdout) == 20
