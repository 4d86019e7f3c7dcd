"""A simulated training service that lives outside the pipeline state.

It has its own table and its own connections, as an external API would: the
pipeline reaches it only through submit / poll / download, never through the
lock's connection. With shards, each shard's database has the table, and a
tenant's jobs are in its shard's. Submission is idempotent on (tenant, run number, stage):
repeating it returns the job already started instead of starting another.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass

import psycopg
from psycopg import pq

#: This process's connection to the service per database (one per shard): (pid, conn).
_connections: dict[str, tuple[int, psycopg.Connection]] = {}


@dataclass(frozen=True)
class Job:
    job_id: int
    ready: bool
    failed: bool
    score: float


def idempotency_key(tenant_id: str, run_number: int, stage: str) -> str:
    return f"{tenant_id}/{run_number}/{stage}"


def _conn(dsn: str) -> psycopg.Connection:
    """This process's connection to the service in database ``dsn``, opened after fork.

    One that is not idle is dropped: a step whose lock was lost gets LockLost raised
    inside it (pglock_on_lost = "interrupt"), which can land while it waits on this
    connection and leave it in the middle of its statement ("another command is
    already in progress" for every later step of the process).
    """
    found = _connections.get(dsn)
    if found is not None and found[0] == os.getpid() and not found[1].closed:
        if found[1].info.transaction_status != pq.TransactionStatus.IDLE:
            found[1].close()
    if found is None or found[0] != os.getpid() or found[1].closed or found[1].broken:
        found = _connections[dsn] = (os.getpid(), psycopg.connect(dsn, autocommit=True))
    return found[1]


def _call(dsn: str, query: str, params: tuple[object, ...]) -> tuple[object, ...] | None:
    """One request to the service; a dropped connection is retried once, as a client would."""
    try:
        return _conn(dsn).execute(query, params).fetchone()
    except psycopg.OperationalError:
        return _conn(dsn).execute(query, params).fetchone()


def submit(
    dsn: str,
    tenant_id: str,
    run_number: int,
    *,
    seconds: float,
    failure_rate: float,
) -> int:
    """Start a training job, or return the one this key already started."""
    key = idempotency_key(tenant_id, run_number, "train")
    failed = random.random() < failure_rate
    row = _call(
        dsn,
        "INSERT INTO training_jobs"
        " (idempotency_key, tenant_id, run_number, ready_at, failed, score)"
        " VALUES (%s, %s, %s, clock_timestamp() + make_interval(secs => %s), %s, %s)"
        " ON CONFLICT (idempotency_key) DO UPDATE SET tenant_id = EXCLUDED.tenant_id"
        " RETURNING job_id",
        (key, tenant_id, run_number, seconds, failed, round(random.uniform(0.5, 1.0), 4)),
    )
    assert row is not None
    return int(row[0])


def poll(dsn: str, job_id: int) -> Job:
    """Return the job's state; an unknown job id is an error."""
    row = _call(
        dsn,
        "SELECT job_id, ready_at <= clock_timestamp(), failed, score"
        " FROM training_jobs WHERE job_id = %s",
        (job_id,),
    )
    if row is None:
        raise LookupError(f"training service: no job {job_id}")
    return Job(*row)


def download(dsn: str, job_id: int) -> float:
    """Fetch a finished job's results (the candidate model's score)."""
    row = _call(
        dsn,
        "UPDATE training_jobs SET downloads = downloads + 1"
        " WHERE job_id = %s AND ready_at <= clock_timestamp() AND NOT failed"
        " RETURNING score",
        (job_id,),
    )
    if row is None:
        raise LookupError(f"training service: job {job_id} has no results to download")
    return float(row[0])
