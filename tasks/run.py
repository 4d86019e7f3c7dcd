"""`make run`: the orchestrator on one machine, with a live view and a summary.

It touches nothing of the user's. Postgres: the server of PGLOCK_DSN, else the
local default, else an embedded one; on it a database of the demo's own
(``--database``, ``pglock_demo``, created when missing; with ``--shards N``, one
per shard, ``pglock_demo_s1`` to ``pglock_demo_sN``), and in each a schema it
made (``--schema``; one it did not make is never dropped). Redis: the broker and
result URLs given (``--broker``, ORCH_BROKER_URL, ORCH_RESULT_BACKEND),
else a database of its own, never 0, on the local or an embedded Redis. It seeds
tenants, starts worker replicas, beat and Flower, waits until each one is up (a
component that does not start ends the run with status 1), and shows each
tenant's stage, holder and skips, each replica's steps and skips, and the cycles
completed. On exit it stops everything it started and prints a summary with the
skips and the overlap check of the step history (expected: 0).
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import json
import os
import random
import re
import secrets
import socket
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import psycopg
import redis
from celery import Celery
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from pglock_celery.dsn import describe_target
from pglock_celery.shards import DEFAULT

from . import fleet
from .services import postgres_service, redis_service
from .view import View

FAST_CLOCK = {
    "ORCH_SCAN_INTERVAL": "1",
    "ORCH_CYCLE_INTERVAL": "2",
    "ORCH_POLL_INTERVAL": "0.5",
    "ORCH_TRAINING_SECONDS": "1",
    "ORCH_STEP_SECONDS": "0.02",
    "ORCH_DOWNLOAD_SECONDS": "1.5",
}
#: Seconds a component may take to come up before the run gives up on it.
START_TIMEOUT = 60.0
#: The comment on a database and a schema that `make run` created: only those it
#: ever drops or resets.
OWNER_MARK = "created by pglock-celery make run"
#: Marks a Redis database as the demo's; one without it is used only when empty.
REDIS_MARK_KEY = "pglock-demo:owner"
#: Redis databases the demo may take, highest first (the tests take them lowest first).
REDIS_DATABASES = range(15, 0, -1)


class NotOurs(Exception):
    """Something the run would have to change belongs to someone else."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="make run", description=__doc__.splitlines()[0])
    parser.add_argument("--tenants", type=int, default=20, help="tenants to seed (20)")
    parser.add_argument("--replicas", type=int, default=3, help="worker replicas (3)")
    parser.add_argument(
        "--duration", type=float, default=0, help="stop after this many seconds (0: Ctrl-C)"
    )
    parser.add_argument(
        "--cycles", type=int, default=0, help="stop once every tenant completed this many"
    )
    parser.add_argument("--fast", action="store_true", help="a fast clock: seconds, not minutes")
    parser.add_argument("--chaos", action="store_true", help="kill and restart random replicas")
    parser.add_argument("--chaos-interval", type=float, default=5.0, help="seconds between kills")
    parser.add_argument("--concurrency", type=int, default=2, help="processes per replica (2)")
    parser.add_argument("--flower-port", type=int, default=5555, help="Flower's port (5555)")
    parser.add_argument(
        "--broker",
        default=os.environ.get("ORCH_BROKER_URL", ""),
        help="broker URL, Redis or RabbitMQ (amqp://...); default: ORCH_BROKER_URL, else "
        "local or embedded Redis. Results and skip counters stay on Redis",
    )
    parser.add_argument(
        "--beats", type=int, default=1, help="beat processes (1; 2 shows a duplicated schedule)"
    )
    parser.add_argument(
        "--database",
        default="pglock_demo",
        help="the demo's own Postgres database on the server found (pglock_demo), created "
        "when missing",
    )
    parser.add_argument(
        "--schema", default="orchestrator", help="Postgres schema in it, made afresh by the run"
    )
    parser.add_argument(
        "--redis-db",
        type=int,
        default=None,
        help="the Redis database of the demo's own (default: the highest of 15 to 1 that is "
        "empty or already the demo's); not used when a broker URL is given",
    )
    parser.add_argument(
        "--shards",
        type=int,
        default=1,
        help="spread the tenants over this many databases of the demo's own (1), "
        "DATABASE_s1 to DATABASE_sN, one shard of pglock_shards each",
    )
    parser.add_argument("--plain", action="store_true", help="status lines, not a live view")
    args = parser.parse_args(argv)
    if min(args.tenants, args.replicas, args.concurrency, args.beats, args.shards) < 1:
        parser.error(
            "--tenants, --replicas, --concurrency, --beats and --shards must be at least 1"
        )
    for option, value in (("--schema", args.schema), ("--database", args.database)):
        if not re.fullmatch(r"[a-z_][a-z0-9_]{0,62}", value):
            parser.error(f"{option} {value!r}: use lowercase letters, digits and _")
    if max(map(len, shard_databases(args.database, args.shards).values())) > 63:
        parser.error(f"--database {args.database!r}: too long for its shards' names")
    if args.redis_db is not None and not 1 <= args.redis_db <= 15:
        parser.error("--redis-db must be 1 to 15 (0 is left to the user)")
    return args


def shard_databases(database: str, shards: int) -> dict[str, str]:
    """The run's shards and their databases: ``database`` alone as the one shard, or
    ``{database}_s1`` ... as shards s1 ..."""
    if shards == 1:
        return {DEFAULT: database}
    return {f"s{n}": f"{database}_s{n}" for n in range(1, shards + 1)}


def lock_settings(shards: dict[str, str]) -> dict[str, str]:
    """The fleet's variables naming its databases: PGLOCK_DSN for one, else PGLOCK_SHARDS.

    The other is set empty, so that one of the user's own never reaches the fleet.
    """
    if len(shards) == 1:
        return {"PGLOCK_DSN": next(iter(shards.values())), "PGLOCK_SHARDS": ""}
    return {"PGLOCK_DSN": "", "PGLOCK_SHARDS": json.dumps(shards)}


def describe_databases(shards: dict[str, str]) -> str:
    """Where the run works, for its first line (no password)."""
    if len(shards) == 1:
        return f"database {describe_target(next(iter(shards.values())))}"
    where = ", ".join(f"{name} {describe_target(dsn)}" for name, dsn in shards.items())
    return f"{len(shards)} shards: {where}"


def schema_dsn(base_dsn: str, schema: str) -> str:
    """The DSN with search_path set to ``schema`` (keeping its own options)."""
    options = str(conninfo_to_dict(base_dsn).get("options") or "")
    return make_conninfo(base_dsn, options=f"{options} -c search_path={schema}".strip())


def demo_database(server_dsn: str, name: str) -> str:
    """The DSN of database ``name`` on ``server_dsn``'s server, created when missing."""
    if conninfo_to_dict(server_dsn).get("dbname") == name:
        return server_dsn
    with psycopg.connect(server_dsn, autocommit=True) as conn:
        found = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone()
        if found is None:
            database = sql.Identifier(name)
            conn.execute(sql.SQL("CREATE DATABASE {}").format(database))
            conn.execute(
                sql.SQL("COMMENT ON DATABASE {} IS {}").format(database, sql.Literal(OWNER_MARK))
            )
            print(f"make run: created the database {name}", flush=True)
    return make_conninfo(server_dsn, dbname=name)


def prepare_database(base_dsn: str, schema: str) -> str:
    """Start from an empty schema of our own; return the DSN that uses it.

    A schema of that name that the run did not make is left alone (NotOurs).
    """
    with psycopg.connect(base_dsn, autocommit=True) as conn, conn.transaction():
        row = conn.execute(
            "SELECT obj_description(oid, 'pg_namespace') FROM pg_namespace WHERE nspname = %s",
            (schema,),
        ).fetchone()
        if row is not None and row[0] != OWNER_MARK:
            database = conn.info.dbname
            raise NotOurs(
                f"the schema {schema} in the database {database} was not made by make run: "
                "it is left as it is; pass another --schema (or --database)"
            )
        name = sql.Identifier(schema)
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(name))
        conn.execute(sql.SQL("CREATE SCHEMA {}").format(name))
        conn.execute(sql.SQL("COMMENT ON SCHEMA {} IS {}").format(name, sql.Literal(OWNER_MARK)))
    return schema_dsn(base_dsn, schema)


def with_db(url: str, db: int) -> str:
    """A Redis URL with its database number replaced."""
    return urlunsplit(urlsplit(url)._replace(path=f"/{db}"))


def demo_redis(server_url: str, wanted: int | None) -> str:
    """A Redis database of the demo's own on ``server_url``'s server: its URL.

    Taken when it is empty or marked as the demo's (the mark is set atomically, so
    a test run claiming the same database at once sees it taken); never 0.
    """
    for db in [wanted] if wanted is not None else REDIS_DATABASES:
        client = redis.Redis.from_url(with_db(server_url, db))
        try:
            fresh = client.set(REDIS_MARK_KEY, "make run", nx=True)
            if fresh and client.dbsize() != 1:
                client.delete(REDIS_MARK_KEY)  # someone else's keys: not ours to use
                continue
            if fresh or client.get(REDIS_MARK_KEY) == b"make run":
                return with_db(server_url, db)
        finally:
            client.close()
    tried = wanted if wanted is not None else "15 to 1"
    raise NotOurs(
        f"no Redis database of the demo's own on {safe_url(server_url)} (tried {tried}): each "
        "holds someone else's keys; pass --redis-db N, or --broker URL to use one you choose"
    )


@dataclass
class Fleet:
    replicas: list[fleet.Process]
    beats: list[fleet.Process]
    flower: fleet.Process
    kills: int = 0
    #: What went wrong with a component (did not start, exited by itself).
    failures: list[str] = field(default_factory=list)

    @property
    def others(self) -> list[fleet.Process]:
        return [*self.beats, self.flower]

    def replica_of(self, pid: int | None) -> str | None:
        for replica in self.replicas:
            if pid in replica.tree():
                return replica.name
        return None

    def stop(self) -> None:
        # Beat first (no new work), then the workers finish what they run.
        for process in [*self.others, *self.replicas]:
            process.stop()


@dataclass(frozen=True)
class FlowerSite:
    url: str
    user: str
    password: str

    def answers(self) -> bool:
        token = base64.b64encode(f"{self.user}:{self.password}".encode()).decode()
        request = urllib.request.Request(
            f"{self.url}healthcheck", headers={"Authorization": f"Basic {token}"}
        )
        try:
            with urllib.request.urlopen(request, timeout=2) as response:
                return bool(response.status == 200)
        except (OSError, urllib.error.URLError):
            return False


def port_problem(port: int) -> str | None:
    """Why Flower could not listen on 127.0.0.1:``port``, or None when it can."""
    with socket.socket() as probe:
        # As Flower (tornado) binds: a port left in TIME_WAIT by a previous run is free.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError as exc:
            return exc.strerror or str(exc)
    return None


def flower_site(port: int) -> tuple[FlowerSite, str]:
    """Flower's address and credentials: FLOWER_BASIC_AUTH when set, else made up now."""
    auth = os.environ.get("FLOWER_BASIC_AUTH") or f"ops:{secrets.token_urlsafe(9)}"
    user, _, password = auth.partition(",")[0].partition(":")
    return FlowerSite(f"http://127.0.0.1:{port}/", user, password), auth


@contextlib.contextmanager
def started_fleet(
    args: argparse.Namespace, env: dict[str, str], logs: Path, flower_auth: str
) -> Iterator[Fleet]:
    replicas = [fleet.replica(n + 1, env, logs, args.concurrency) for n in range(args.replicas)]
    beats = [fleet.beat(f"beat{n + 1}", env, logs) for n in range(args.beats)]
    flower_env = {**env, "FLOWER_BASIC_AUTH": flower_auth}
    crew = Fleet(replicas, beats, fleet.flower(args.flower_port, flower_env, logs))
    try:
        for process in [*replicas, *crew.others]:
            process.start()
        yield crew
    finally:
        crew.stop()


def wait_until_up(crew: Fleet, app: Celery, site: FlowerSite) -> list[str]:
    """Wait until every replica answers a ping, beat runs and Flower serves.

    Returns one line per component that exited or did not come up in time.
    """
    host = socket.gethostname()
    pending = {replica.name: replica for replica in crew.replicas}
    flower_up = False
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        exited = [p for p in [*crew.replicas, *crew.others] if not p.alive()]
        if exited:
            return [exit_report(p) for p in exited]
        if pending:
            answered = app.control.ping(
                destination=[f"{name}@{host}" for name in pending], timeout=0.5
            )
            for reply in answered:
                for node in reply:
                    pending.pop(node.split("@")[0], None)
        flower_up = flower_up or site.answers()
        if not pending and flower_up:
            return []
        time.sleep(0.2)
    late = [f"{name} did not answer a ping within {START_TIMEOUT:.0f} s" for name in pending]
    if not flower_up:
        late.append(f"flower did not serve {site.url} within {START_TIMEOUT:.0f} s")
    return late


def exit_report(process: fleet.Process) -> str:
    """One line on a process that exited: its status and the last line of its log."""
    status = process.process.returncode if process.process is not None else None
    last = process.log_tail(1).strip() or "(empty log)"
    return f"{process.name} exited with status {status}: {last} (log: {process.log})"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    problem = port_problem(args.flower_port)
    if problem is not None:
        print(
            f"make run: Flower's port {args.flower_port} on 127.0.0.1 is taken ({problem}):"
            " stop what listens there or pass --flower-port",
            file=sys.stderr,
        )
        return 2
    work = Path(tempfile.mkdtemp(prefix="pglock-run-"))
    logs = work / "logs"
    logs.mkdir()
    with contextlib.ExitStack() as stack:
        server_dsn = stack.enter_context(postgres_service(work / "postgres", "PGLOCK_DSN"))
        # Results and skip counters live on Redis, whatever the broker.
        results = os.environ.get("ORCH_RESULT_BACKEND", "")
        if not results and os.environ.get("ORCH_BROKER_URL", "").startswith("redis"):
            results = os.environ["ORCH_BROKER_URL"]
        try:
            if not results:
                server_url = stack.enter_context(
                    redis_service(work / "redis", "ORCH_RESULT_BACKEND")
                )
                results = demo_redis(server_url, args.redis_db)
            broker = args.broker or results
            # Shard name -> DSN: the one database, or one per shard.
            shards = {
                name: prepare_database(demo_database(server_dsn, database), args.schema)
                for name, database in shard_databases(args.database, args.shards).items()
            }
        except NotOurs as exc:
            print(f"make run: {exc}", file=sys.stderr)
            return 2
        env = {
            **lock_settings(shards),
            "ORCH_BROKER_URL": broker,
            "ORCH_RESULT_BACKEND": results,
            "ORCH_QUEUE": f"pipelines-{args.schema}",
            **(FAST_CLOCK if args.fast else {}),
        }
        os.environ.update(env)  # this process's `tasks` app reads the same settings
        from .celery_app import app
        from .pipeline import skip_keys
        from .schema import apply_schema
        from .tenants import seed_tenants

        for dsn in shards.values():
            apply_schema(dsn)
        # Each tenant into its shard's database, as the fleet's settings place it.
        seed_tenants(None, [f"tenant-{n:03d}" for n in range(1, args.tenants + 1)])
        app.control.purge()
        app.backend.client.delete(*skip_keys(env["ORCH_QUEUE"]))
        print(
            f"{describe_databases(shards)}, broker {safe_url(broker)},"
            f" results {safe_url(results)}, logs in {logs}",
            flush=True,
        )
        site, flower_auth = flower_site(args.flower_port)
        started = time.monotonic()
        with started_fleet(args, env, logs, flower_auth) as crew:
            crew.failures.extend(wait_until_up(crew, app, site))
            if crew.failures:
                for failure in crew.failures:
                    print(f"make run: {failure}", file=sys.stderr, flush=True)
            else:
                print(
                    f"Flower: {site.url} (user {site.user}, password {site.password})"
                    f" | {args.replicas} replicas, {args.beats} beat(s) up", flush=True,
                )  # fmt: skip
                view = View(args, crew, shards, app, started)
                try:
                    run_until_done(args, crew, view)
                except KeyboardInterrupt:
                    print("interrupted: stopping the replicas, beat and Flower", flush=True)
            elapsed = time.monotonic() - started
        return print_summary(args, shards, app, elapsed, crew, site)
    return 0


def safe_url(url: str) -> str:
    """A broker URL without its password."""
    return re.sub(r"(//[^:/@]*:)[^@/]*@", r"\1****@", url)


def run_until_done(args: argparse.Namespace, crew: Fleet, view: View) -> None:
    rng = random.Random()
    deadline = time.monotonic() + args.duration if args.duration > 0 else None
    next_kill = time.monotonic() + args.chaos_interval
    with view:
        while deadline is None or time.monotonic() < deadline:
            cycles = view.refresh()
            if args.cycles and cycles >= args.cycles:
                break
            if args.chaos and time.monotonic() >= next_kill:
                victim = rng.choice(crew.replicas)
                victim.kill()
                victim.start()
                crew.kills += 1
                next_kill = time.monotonic() + args.chaos_interval
            for replica in crew.replicas:  # a replica that died on its own comes back
                if not replica.alive():
                    crew.failures.append(exit_report(replica) + "; started again")
                    replica.start()
            stopped = [process for process in crew.others if not process.alive()]
            if stopped:  # without beat nothing is due; without Flower nothing is shown
                crew.failures.extend(exit_report(process) for process in stopped)
                break
            time.sleep(0.5)
    for failure in crew.failures:
        print(f"make run: {failure}", file=sys.stderr, flush=True)


def skip_counts(app: Celery, key: str) -> dict[str, int]:
    """A Redis hash of skip counters: {worker or tenant: skips}."""
    return {k.decode(): int(v) for k, v in app.backend.client.hgetall(key).items()}


def print_summary(
    args: argparse.Namespace,
    shards: dict[str, str],
    app: Celery,
    elapsed: float,
    crew: Fleet,
    site: FlowerSite,
) -> int:
    from .pipeline import skip_keys
    from .report import combine, summarize

    parts = {}
    for name, dsn in shards.items():
        with psycopg.connect(dsn) as conn:
            parts[name] = summarize(conn)
    summary = combine(list(parts.values()))
    node_key, tenant_key = skip_keys(app.conf.task_default_queue)
    by_node, by_tenant = skip_counts(app, node_key), skip_counts(app, tenant_key)
    per_replica = ", ".join(
        f"{r.name} {sum(n for node, n in by_node.items() if node.startswith(r.name + '@'))}"
        for r in crew.replicas
    )
    print(f"\nsummary after {elapsed:.1f} s with {len(crew.replicas)} replicas:")
    for line in summary.lines():
        print(f"  {line}")
    if len(parts) > 1:
        each = "; ".join(f"{n}: {p.tenants} tenants, {p.steps} steps" for n, p in parts.items())
        print(f"  shards             {len(parts)} ({each})")
    print(f"  skips              {sum(by_node.values())} (a step found its tenant locked by")
    print(f"                     another worker process: {per_replica}; {len(by_tenant)} tenants)")
    print(f"  replica kills      {crew.kills}")
    if crew.failures:
        print(f"  failed components  {len(crew.failures)} (expected: 0)")
        for failure in crew.failures:
            print(f"    {failure}")
    else:
        print(f"  Flower             served at {site.url} for the whole run")
    healthy = summary.overlaps == 0 and summary.duplicate_jobs == 0
    if not healthy:
        print("result: FAILED (overlaps or duplicate jobs)")
    elif crew.failures:
        print("result: FAILED (a component did not start or exited: see above)")
    else:
        print("result: OK")
    return 0 if healthy and not crew.failures else 1


if __name__ == "__main__":
    sys.exit(main())
