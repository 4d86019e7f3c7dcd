"""What the step history says: overlaps, cycles, training jobs, stuck tenants."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import psycopg

from pglock_celery.inspect import list_holders

# A step overlaps when it starts before the latest end of the earlier steps of
# the same tenant (ties broken by id, so identical starts are compared too).
OVERLAPS = """
SELECT count(*) FROM (
  SELECT started_at, max(finished_at) OVER (
      PARTITION BY tenant_id ORDER BY started_at, id
      ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING) AS previous_end
  FROM step_history) steps
WHERE started_at < previous_end
"""

# Runs (cycles started) against training jobs submitted for them.
DUPLICATE_JOBS = """
SELECT count(*) FROM (
  SELECT tenant_id, run_number FROM training_jobs
  GROUP BY tenant_id, run_number HAVING count(*) > 1) duplicates
"""

SUBMITS_PER_RUN = """
SELECT count(*) FROM (
  SELECT tenant_id, run_number FROM step_history WHERE outcome = 'submitted'
  GROUP BY tenant_id, run_number HAVING count(*) > 1) repeated
"""


@dataclass(frozen=True)
class Summary:
    tenants: int
    completed_cycles: int
    min_cycles: int
    steps: int
    training_jobs: int
    duplicate_jobs: int
    repeated_submits: int
    overlaps: int
    stopped: int

    def lines(self) -> list[str]:
        return [
            f"tenants            {self.tenants}",
            f"completed cycles   {self.completed_cycles} (fewest for a tenant: {self.min_cycles})",
            f"steps run          {self.steps}",
            f"training jobs      {self.training_jobs}",
            f"duplicate jobs     {self.duplicate_jobs} (expected: 0)",
            f"repeated submits   {self.repeated_submits} (expected: 0)",
            f"overlapping steps  {self.overlaps} (expected: 0)",
            f"stopped tenants    {self.stopped}",
        ]


def summarize(conn: psycopg.Connection) -> Summary:
    def one(query: str) -> int:
        row = conn.execute(query).fetchone()
        return int(row[0]) if row and row[0] is not None else 0

    return Summary(
        tenants=one("SELECT count(*) FROM pipelines"),
        completed_cycles=one("SELECT sum(completed_cycles) FROM pipelines"),
        min_cycles=one("SELECT min(completed_cycles) FROM pipelines"),
        steps=one("SELECT count(*) FROM step_history"),
        training_jobs=one("SELECT count(*) FROM training_jobs"),
        duplicate_jobs=one(DUPLICATE_JOBS),
        repeated_submits=one(SUBMITS_PER_RUN),
        overlaps=one(OVERLAPS),
        stopped=one("SELECT count(*) FROM pipelines WHERE stage = 'stopped'"),
    )


def combine(parts: Sequence[Summary]) -> Summary:
    """Several shards' summaries as one: each tenant lives on one shard, so counts add up."""
    totals = {
        field.name: sum(getattr(part, field.name) for part in parts)
        for field in dataclasses.fields(Summary)
    }
    totals["min_cycles"] = min((part.min_cycles for part in parts if part.tenants), default=0)
    return Summary(**totals)


@dataclass(frozen=True)
class TenantRow:
    tenant_id: str
    stage: str
    run_number: int
    completed_cycles: int
    model_version: int
    last_error: str | None
    #: pid of the worker process that holds the tenant's lock now, if any.
    holder_pid: int | None


def tenant_rows(conn: psycopg.Connection) -> list[TenantRow]:
    """Each tenant's pipeline and who holds its lock right now."""
    holders = {h.name: h.worker_pid for h in list_holders(conn) if h.name is not None}
    rows = conn.execute(
        "SELECT tenant_id, stage, run_number, completed_cycles, model_version, last_error"
        " FROM pipelines ORDER BY tenant_id"
    ).fetchall()
    return [TenantRow(*row, holder_pid=holders.get(f"training:{row[0]}")) for row in rows]
