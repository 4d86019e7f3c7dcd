"""`make run`: the orchestrator on one machine, with a live view and a summary.

Finds Postgres and Redis (PGLOCK_DSN / ORCH_BROKER_URL, else the local
defaults, else embedded servers), applies the schema in its own Postgres
schema, seeds tenants, starts worker replicas, beat and Flower, and shows each
tenant's stage and holder, each replica's steps and skips, and the cycles
completed. On exit it stops everything it started and prints a summary with
the overlap check of the step history (expected: 0).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import re
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from pglock_celery.dsn import describe_target

from . import fleet
from .services import postgres_service, redis_service
from .view import View

FAST_CLOCK = {
    "ORCH_SCAN_INTERVAL": "1",
    "ORCH_CYCLE_INTERVAL": "2",
    "ORCH_POLL_INTERVAL": "0.5",
    "ORCH_TRAINING_SECONDS": "1",
    "ORCH_STEP_SECONDS": "0.02",
}


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
    parser.add_argument("--schema", default="orchestrator", help="Postgres schema to use")
    parser.add_argument("--plain", action="store_true", help="status lines, not a live view")
    args = parser.parse_args(argv)
    if args.tenants < 1 or args.replicas < 1 or args.concurrency < 1:
        parser.error("--tenants, --replicas and --concurrency must be at least 1")
    if not re.fullmatch(r"[a-z_][a-z0-9_]{0,62}", args.schema):
        parser.error(f"--schema {args.schema!r}: use lowercase letters, digits and _")
    return args


def schema_dsn(base_dsn: str, schema: str) -> str:
    """The DSN with search_path set to ``schema`` (keeping its own options)."""
    options = str(conninfo_to_dict(base_dsn).get("options") or "")
    return make_conninfo(base_dsn, options=f"{options} -c search_path={schema}".strip())


def prepare_database(base_dsn: str, schema: str) -> str:
    """Start from an empty schema of our own; return the DSN that uses it."""
    with psycopg.connect(base_dsn, autocommit=True) as conn:
        conn.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")
        conn.execute(f"CREATE SCHEMA {schema}")
    return schema_dsn(base_dsn, schema)


@dataclass
class Fleet:
    replicas: list[fleet.Process]
    others: list[fleet.Process] = field(default_factory=list)
    kills: int = 0

    def replica_of(self, pid: int | None) -> str | None:
        for replica in self.replicas:
            if pid in replica.tree():
                return replica.name
        return None

    def stop(self) -> None:
        # Beat first (no new work), then the workers finish what they run.
        for process in [*self.others, *self.replicas]:
            process.stop()


@contextlib.contextmanager
def started_fleet(args: argparse.Namespace, env: dict[str, str], logs: Path) -> Iterator[Fleet]:
    replicas = [fleet.replica(n + 1, env, logs, args.concurrency) for n in range(args.replicas)]
    crew = Fleet(
        replicas, [fleet.beat("beat", env, logs), fleet.flower(args.flower_port, env, logs)]
    )
    try:
        for process in [*replicas, *crew.others]:
            process.start()
        yield crew
    finally:
        crew.stop()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="pglock-run-"))
    logs = work / "logs"
    logs.mkdir()
    with contextlib.ExitStack() as stack:
        base_dsn = stack.enter_context(postgres_service(work / "postgres", "PGLOCK_DSN"))
        broker = stack.enter_context(redis_service(work / "redis", "ORCH_BROKER_URL"))
        dsn = prepare_database(base_dsn, args.schema)
        env = {
            "PGLOCK_DSN": dsn,
            "ORCH_BROKER_URL": broker,
            "ORCH_RESULT_BACKEND": broker,
            "ORCH_QUEUE": f"pipelines-{args.schema}",
            **(FAST_CLOCK if args.fast else {}),
        }
        os.environ.update(env)  # this process's `tasks` app reads the same settings
        from .celery_app import app
        from .pipeline import SKIPS_KEY
        from .schema import apply_schema
        from .tenants import seed_tenants

        apply_schema(dsn)
        seed_tenants(dsn, [f"tenant-{n:03d}" for n in range(1, args.tenants + 1)])
        app.control.purge()
        app.backend.client.delete(SKIPS_KEY)
        print(f"database {describe_target(dsn)}, broker {broker}, logs in {logs}", flush=True)
        started = time.monotonic()
        with started_fleet(args, env, logs) as crew:
            view = View(args, crew, dsn, app, started)
            try:
                run_until_done(args, crew, dsn, view)
            except KeyboardInterrupt:
                print("interrupted: stopping the replicas, beat and Flower", flush=True)
        return print_summary(args, dsn, time.monotonic() - started, crew)
    return 0


def run_until_done(args: argparse.Namespace, crew: Fleet, dsn: str, view: View) -> None:
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
                    replica.start()
            time.sleep(0.5)


def print_summary(args: argparse.Namespace, dsn: str, elapsed: float, crew: Fleet) -> int:
    from .report import summarize

    with psycopg.connect(dsn) as conn:
        summary = summarize(conn)
    print(f"\nsummary after {elapsed:.1f} s with {len(crew.replicas)} replicas:")
    for line in summary.lines():
        print(f"  {line}")
    print(f"  replica kills      {crew.kills}")
    print(f"  Flower was served at http://127.0.0.1:{args.flower_port}/")
    healthy = summary.overlaps == 0 and summary.duplicate_jobs == 0
    print("result: OK" if healthy else "result: FAILED (overlaps or duplicate jobs)")
    return 0 if healthy else 1


if __name__ == "__main__":
    sys.exit(main())
