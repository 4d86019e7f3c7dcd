"""One tenant's retraining pipeline, advanced one locked step at a time.

due -> (submit a training job) -> training -> (poll until it is done)
    -> downloading -> (fetch the results) -> evaluating
    -> (promote the candidate, or keep the old model when its score fell)
    -> due again after the cycle interval.

Every step is one ``advance_pipeline`` call under the lock
``training:{tenant_id}``. It reads and writes the pipeline row only through
``current_lock().connection``, inside a transaction, so a step whose lock is
gone cannot commit. The training service is external: reached through its
own connection, with an idempotency key per (tenant, run, stage), so a step
repeated after a crash finds the job it already started. With shards, a
tenant's rows and its training jobs live in its lock's shard's database
(shards.py), and the scan reads every shard.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import os
from dataclasses import dataclass
from typing import Any

import psycopg
from celery.utils.log import get_task_logger

from pglock_celery import TenantLockedTask, current_lock

from . import training
from .celery_app import app
from .schema import STAGES, STOPPED
from .shards import shard_dsns

logger = get_task_logger(__name__)

#: Errors in a row before a tenant is stopped for an operator to look at.
MAX_ATTEMPTS = 5


def skip_keys(queue: str) -> tuple[str, str]:
    """The Redis hashes counting one queue's skipped steps: per worker node, per tenant."""
    return f"orchestrator:skips:{queue}", f"orchestrator:skips-by-tenant:{queue}"


#: Step messages per broker round trip when a scan fans out.
BATCH = 500


class UnknownTenant(LookupError):
    """A step was asked for a tenant that does not exist."""


@dataclass
class Pipeline:
    tenant_id: str
    stage: str
    run_number: int
    job_id: int | None
    attempts: int
    model_version: int
    model_score: float | None
    candidate_score: float | None
    completed_cycles: int


class PipelineTask(TenantLockedTask):
    """Counts skips per replica and per tenant, for the live view and the summary."""

    def on_lock_skipped(
        self, lock_name: str, holder: dict[str, Any] | None, args: Any, kwargs: Any
    ) -> Any:
        try:
            by_node, by_tenant = skip_keys(app.conf.task_default_queue)
            with app.backend.client.pipeline() as counters:
                counters.hincrby(by_node, self.request.hostname or "?", 1)
                counters.hincrby(by_tenant, lock_name.removeprefix("training:"), 1)
                counters.execute()
        except Exception as exc:  # a counter must never fail a step
            logger.warning("could not count a skip: %s", exc)
        return super().on_lock_skipped(lock_name, holder, args, kwargs)


def _seconds(name: str) -> float:
    return float(app.conf[f"orchestrator_{name}"])


def _load(conn: psycopg.Connection, tenant_id: str) -> tuple[Pipeline, bool] | None:
    row = conn.execute(
        "SELECT tenant_id, stage, run_number, job_id, attempts, model_version, model_score,"
        " candidate_score, completed_cycles, next_due_at <= clock_timestamp()"
        " FROM pipelines WHERE tenant_id = %s",
        (tenant_id,),
    ).fetchone()
    if row is None:
        return None
    return Pipeline(*row[:-1]), bool(row[-1])


def _step(p: Pipeline, dsn: str) -> tuple[str, dict[str, Any], float]:
    """Do the work of the pipeline's current stage.

    Returns (outcome, column changes, seconds until the tenant is due again).
    """
    if p.stage == "due":
        run = p.run_number + 1
        job_id = training.submit(
            dsn,
            p.tenant_id,
            run,
            seconds=_seconds("training_seconds"),
            failure_rate=float(app.conf.orchestrator_training_failure_rate),
        )
        changes = {"stage": "training", "run_number": run, "job_id": job_id}
        return "submitted", changes, _seconds("poll_interval")
    if p.stage == "training":
        assert p.job_id is not None
        job = training.poll(dsn, p.job_id)
        if not job.ready:
            return "waiting", {}, _seconds("poll_interval")
        if job.failed:
            changes = {
                "stage": "due",
                "job_id": None,
                "attempts": p.attempts + 1,
                "last_error": f"training job {job.job_id} of run {p.run_number} failed",
            }
            return "job-failed", changes, _seconds("poll_interval")
        return "trained", {"stage": "downloading"}, 0.0
    if p.stage == "downloading":
        assert p.job_id is not None
        score = training.download(dsn, p.job_id)
        # Fetching the model's artifacts outlasts a scan interval, as it does in a real
        # fleet: the scans meanwhile find the tenant still due and send it again, and
        # those steps skip on whichever replica gets them. lock.sleep() raises LockLost
        # as soon as the lock is found lost.
        lock = current_lock()
        assert lock is not None
        lock.sleep(_seconds("download_seconds"))
        return "downloaded", {"stage": "evaluating", "candidate_score": score}, 0.0
    # evaluating: promote only a candidate at least as good as the model in use.
    assert p.candidate_score is not None
    changes: dict[str, Any] = {
        "stage": "due",
        "job_id": None,
        "candidate_score": None,
        "attempts": 0,
        "last_error": None,
        "completed_cycles": p.completed_cycles + 1,
    }
    if p.model_score is None or p.candidate_score >= p.model_score:
        changes |= {"model_version": p.model_version + 1, "model_score": p.candidate_score}
        return "promoted", changes, _seconds("cycle_interval")
    return "kept", changes, _seconds("cycle_interval")


def _save(
    conn: psycopg.Connection,
    p: Pipeline,
    outcome: str,
    changes: dict[str, Any],
    due_in: float,
    started: dt.datetime,
) -> None:
    """Write the step's changes and its history row in one transaction."""
    columns = ", ".join(f"{name} = %({name})s" for name in changes)
    with conn.transaction():
        conn.execute(
            "UPDATE pipelines SET "
            + (columns + ", " if columns else "")
            + "next_due_at = clock_timestamp() + make_interval(secs => %(due_in)s),"
            " updated_at = clock_timestamp() WHERE tenant_id = %(tenant_id)s",
            {**changes, "due_in": due_in, "tenant_id": p.tenant_id},
        )
        conn.execute(
            "INSERT INTO step_history (tenant_id, run_number, stage, outcome, worker,"
            " worker_pid, session_pid, started_at, finished_at)"
            " VALUES (%s, %s, %s, %s, %s, %s, pg_backend_pid(), %s, clock_timestamp())",
            (
                p.tenant_id,
                changes.get("run_number", p.run_number),
                p.stage,
                outcome,
                advance_pipeline.request.hostname or "local",
                os.getpid(),
                started,
            ),
        )


@app.task(base=PipelineTask, lock_name="training:{tenant_id}")
def advance_pipeline(tenant_id: str) -> dict[str, Any]:
    """Advance one tenant's pipeline by one step, if it is due."""
    lock = current_lock()
    assert lock is not None
    conn = lock.connection
    started = conn.execute("SELECT clock_timestamp()").fetchone()
    assert started is not None
    loaded = _load(conn, tenant_id)
    if loaded is None:
        raise UnknownTenant(f"no tenant {tenant_id!r}: step refused, no training action taken")
    pipeline, due = loaded
    if pipeline.stage == STOPPED or not due:
        return {"tenant": tenant_id, "outcome": "not-due", "stage": pipeline.stage}
    if pipeline.stage not in STAGES:
        error = f"unknown stage {pipeline.stage!r}: tenant stopped for an operator"
        logger.error("tenant %s: %s", tenant_id, error)
        _save(conn, pipeline, STOPPED, {"stage": STOPPED, "last_error": error}, 0.0, started[0])
        return {"tenant": tenant_id, "outcome": STOPPED, "error": error}
    # Simulated work of the step itself (feature extraction, bookkeeping).
    conn.execute("SELECT pg_sleep(%s)", (_seconds("step_seconds"),))
    dsn = lock.config.require_dsn()  # the database of the tenant's shard
    try:
        outcome, changes, due_in = _step(pipeline, dsn)
    except (LookupError, psycopg.Error) as exc:
        if isinstance(exc, psycopg.Error) and conn.closed:
            raise
        attempts = pipeline.attempts + 1
        stop = attempts >= MAX_ATTEMPTS
        changes = {"attempts": attempts, "last_error": f"{type(exc).__name__}: {exc}"}
        if stop:
            changes["stage"] = STOPPED
        outcome, due_in = ("stopped" if stop else "error"), _seconds("poll_interval")
        logger.warning("tenant %s: step %s failed: %s", tenant_id, pipeline.stage, exc)
    _save(conn, pipeline, outcome, changes, due_in, started[0])
    return {"tenant": tenant_id, "outcome": outcome, "stage": changes.get("stage", pipeline.stage)}


@app.task
def scan_due_tenants(limit: int = 10_000) -> int:
    """Send one step per due tenant of every shard: beat's job. Duplicates only cost skips.

    At most ``limit`` steps, the longest due first.
    """
    due: list[tuple[str, dt.datetime]] = []
    for dsn in shard_dsns().values():
        with psycopg.connect(dsn) as conn:
            due += conn.execute(
                "SELECT tenant_id, next_due_at FROM pipelines"
                " WHERE stage <> %s AND next_due_at <= now() ORDER BY next_due_at LIMIT %s",
                (STOPPED, limit),
            ).fetchall()
    due = sorted(due, key=lambda row: row[1])[:limit]
    # A step message older than a few scans is stale: a newer scan re-sent it.
    expires = max(10.0, 5 * float(app.conf.beat_schedule["scan-due-tenants"]["schedule"]))
    with app.producer_or_acquire() as producer:
        # kombu 5.7+ pipelines the publishes (one Redis round trip per batch);
        # older kombu publishes them one by one.
        batch = getattr(producer, "batch", None)
        with batch(max_size=BATCH) if batch is not None else contextlib.nullcontext():
            for tenant_id, _ in due:
                advance_pipeline.apply_async((tenant_id,), producer=producer, expires=expires)
    return len(due)
