"""The orchestrator on real services, in a Postgres schema and queue of its own."""

from __future__ import annotations

import uuid
from pathlib import Path

import psycopg
import redis
from celery import Celery

from tasks import fleet
from tasks.pipeline import skip_keys
from tasks.report import Summary, summarize
from tasks.run import prepare_database
from tasks.schema import apply_schema
from tasks.tenants import seed_tenants

#: A fast clock: scans every second, training takes half a second.
FAST = {
    "ORCH_SCAN_INTERVAL": "1",
    "ORCH_CYCLE_INTERVAL": "1",
    "ORCH_POLL_INTERVAL": "0.3",
    "ORCH_TRAINING_SECONDS": "0.5",
    "ORCH_TRAINING_FAILURE_RATE": "0",
    "ORCH_STEP_SECONDS": "0.02",
    "ORCH_DOWNLOAD_SECONDS": "0.2",
}


class Orchestra:
    """Replicas and beats of the `tasks` app on one test's schema and queue."""

    def __init__(
        self, base_dsn: str, broker: str, log_dir: Path, app: Celery | None, **clock: str
    ) -> None:
        """With ``app``, it is pointed at this orchestra for sending tasks; else left alone."""
        self.schema = f"orch_{uuid.uuid4().hex[:10]}"
        self.base_dsn = base_dsn
        self.dsn = prepare_database(base_dsn, self.schema)
        self.queue = f"pipelines-{self.schema}"
        self.env = {
            "PGLOCK_DSN": self.dsn,
            "ORCH_BROKER_URL": broker,
            "ORCH_RESULT_BACKEND": broker,
            "ORCH_QUEUE": self.queue,
            **FAST,
            **clock,
        }
        self.log_dir = log_dir / self.schema
        self.log_dir.mkdir(parents=True)
        if app is not None:
            app.conf.update(
                broker_url=broker,
                result_backend=broker,
                task_default_queue=self.queue,
                pglock_dsn=self.dsn,
            )
            app.backend.client.delete(*skip_keys(self.queue))
        self.processes: list[fleet.Process] = []
        apply_schema(self.dsn)

    def seed(self, count: int) -> list[str]:
        tenants = [f"tenant-{n:03d}" for n in range(1, count + 1)]
        seed_tenants(self.dsn, tenants)
        return tenants

    def replicas(self, count: int, concurrency: int = 2) -> list[fleet.Process]:
        started = []
        for _ in range(count):
            number = len([p for p in self.processes if p.name.startswith("replica")]) + 1
            replica = fleet.replica(number, self.env, self.log_dir, concurrency)
            replica.start()
            self.processes.append(replica)
            started.append(replica)
        return started

    def beat(self) -> fleet.Process:
        number = len([p for p in self.processes if p.name.startswith("beat")]) + 1
        process = fleet.beat(f"beat{number}", self.env, self.log_dir)
        process.start()
        self.processes.append(process)
        return process

    def connect(self) -> psycopg.Connection:
        return psycopg.connect(self.dsn, autocommit=True)

    def summary(self) -> Summary:
        with self.connect() as conn:
            return summarize(conn)

    def skips(self) -> int:
        """Steps that found their tenant locked by another replica, all replicas together."""
        by_node, _ = skip_keys(self.queue)
        counts = redis.Redis.from_url(self.env["ORCH_RESULT_BACKEND"]).hvals(by_node)
        return sum(int(count) for count in counts)

    def contended_tenants(self) -> int:
        """Tenants whose steps ran on more than one replica."""
        with self.connect() as conn:
            row = conn.execute(
                "SELECT count(*) FROM (SELECT tenant_id FROM step_history"
                " GROUP BY tenant_id HAVING count(DISTINCT worker) > 1) AS shared"
            ).fetchone()
        return int(row[0]) if row else 0

    def cycles(self) -> dict[str, int]:
        with self.connect() as conn:
            return dict(
                conn.execute("SELECT tenant_id, completed_cycles FROM pipelines").fetchall()
            )

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.log_tail()}" for p in self.processes)

    def close(self) -> None:
        for process in self.processes:
            process.stop()
        redis.Redis.from_url(self.env["ORCH_RESULT_BACKEND"]).delete(*skip_keys(self.queue))
        with psycopg.connect(self.base_dsn, autocommit=True) as conn:
            conn.execute(f"DROP SCHEMA IF EXISTS {self.schema} CASCADE")
