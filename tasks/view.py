"""The live terminal view of `make run`: tenants, replicas, cycles."""

from __future__ import annotations

import time
from collections import Counter
from types import TracebackType
from typing import TYPE_CHECKING, Any, Protocol

import psycopg
from rich.console import Console, Group
from rich.live import Live
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn
from rich.table import Table

from .pipeline import skip_keys
from .report import TenantRow, tenant_rows

if TYPE_CHECKING:
    import argparse

    from celery import Celery

    from .fleet import Process


class Fleet(Protocol):
    """What the view reads of the running fleet (run.Fleet)."""

    replicas: list[Process]
    kills: int

    def replica_of(self, pid: int | None) -> str | None: ...


MAX_TENANT_ROWS = 25
STEPS_BY_WORKER = "SELECT worker, count(*) FROM step_history GROUP BY worker"


class View:
    """Reads every shard's database and Redis, and draws (or prints) what it sees."""

    def __init__(
        self,
        args: argparse.Namespace,
        crew: Fleet,
        shards: dict[str, str],
        app: Celery,
        started: float,
    ) -> None:
        """``shards``: each shard's name and DSN (one, for a run without shards)."""
        self.args = args
        self.crew = crew
        self.shards = shards
        self.app = app
        self.started = started
        self.console = Console()
        self.plain = args.plain or not self.console.is_terminal
        self.live: Live | None = None
        self.last_line = 0.0
        self.progress = Progress(TextColumn("cycles"), BarColumn(), MofNCompleteColumn())
        # With a cycle target the bar fills towards it; without one it counts on.
        self.bar = self.progress.add_task(
            "cycles", total=args.tenants * args.cycles if args.cycles else None
        )

    def __enter__(self) -> View:
        if not self.plain:
            self.live = Live(console=self.console, refresh_per_second=2)
            self.live.__enter__()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self.live is not None:
            self.live.__exit__(exc_type, exc, tb)

    def refresh(self) -> int:
        """Redraw; return the fewest cycles any tenant has completed."""
        tenants: list[TenantRow] = []
        steps: Counter[str] = Counter()  # by worker node
        shard_steps: dict[str, int] = {}
        for name, dsn in self.shards.items():
            with psycopg.connect(dsn) as conn:
                tenants += tenant_rows(conn)
                found: dict[str, int] = dict(conn.execute(STEPS_BY_WORKER).fetchall())
            steps.update(found)
            shard_steps[name] = sum(found.values())
        tenants.sort(key=lambda t: t.tenant_id)
        # Each shard's steps, when there are several: " (s1 40, s2 52, s3 38)".
        each = ", ".join(f"{name} {n}" for name, n in shard_steps.items())
        per_shard = f" ({each})" if len(shard_steps) > 1 else ""
        by_node, by_tenant = skip_keys(self.app.conf.task_default_queue)
        skips, tenant_skips = self._counts(by_node), self._counts(by_tenant)
        fewest = min((t.completed_cycles for t in tenants), default=0)
        target = self.args.cycles
        done = sum(
            min(t.completed_cycles, target) if target else t.completed_cycles for t in tenants
        )
        self.progress.update(self.bar, completed=done)
        if self.plain:
            if time.monotonic() - self.last_line >= 5:
                self.last_line = time.monotonic()
                stages: dict[str, int] = {}
                for t in tenants:
                    stages[t.stage] = stages.get(t.stage, 0) + 1
                goal = f"/{self.args.tenants * target}" if target else ""
                per_replica = " ".join(
                    f"{r.name}:{self._of(r.name, skips)}" for r in self.crew.replicas
                )
                print(
                    f"[{time.monotonic() - self.started:6.1f} s] cycles {done}{goal}"
                    f" stages {stages} steps {sum(steps.values())}{per_shard}"
                    f" skips {sum(skips.values())} ({per_replica}) kills {self.crew.kills}",
                    flush=True,
                )
        elif self.live is not None:
            self.live.update(
                Group(
                    self._tenants(tenants, tenant_skips),
                    self._replicas(steps, skips, per_shard),
                    self.progress,
                )
            )
        return fewest

    def _counts(self, key: str) -> dict[str, int]:
        hash_ = self.app.backend.client.hgetall(key)
        return {name.decode(): int(value) for name, value in hash_.items()}

    def _tenants(self, tenants: list[Any], skips: dict[str, int]) -> Table:
        table = Table(title="tenants", expand=False)
        columns = ("tenant", "stage", "run", "cycles", "model", "held by", "skips", "last error")
        for column in columns:
            table.add_column(column)
        for t in tenants[:MAX_TENANT_ROWS]:
            holder = self.crew.replica_of(t.holder_pid) or str(t.holder_pid or "")
            table.add_row(
                t.tenant_id,
                t.stage,
                str(t.run_number),
                str(t.completed_cycles),
                f"v{t.model_version}",
                holder,
                str(skips.get(t.tenant_id, 0)),
                (t.last_error or "")[:40],
            )
        if len(tenants) > MAX_TENANT_ROWS:
            table.caption = f"and {len(tenants) - MAX_TENANT_ROWS} more"
        return table

    @staticmethod
    def _of(replica: str, counts: dict[str, int]) -> int:
        """A replica's count in a hash keyed by node name (replica1@host)."""
        return sum(n for node, n in counts.items() if node.startswith(replica + "@"))

    def _replicas(self, steps: dict[str, int], skips: dict[str, int], per_shard: str) -> Table:
        table = Table(title=f"replicas (chaos kills: {self.crew.kills})")
        if per_shard:
            table.caption = f"steps per shard{per_shard}"
        for column in ("replica", "pid", "state", "steps run", "skips", "starts"):
            table.add_column(column)
        for replica in self.crew.replicas:
            table.add_row(
                replica.name,
                str(replica.pid or ""),
                "up" if replica.alive() else "down",
                str(self._of(replica.name, steps)),
                str(self._of(replica.name, skips)),
                str(replica.starts),
            )
        return table
