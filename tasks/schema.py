"""The orchestrator's tables, applied idempotently at start.

Pipeline state (tenants, pipelines, step_history, onboarding_history) is
written only through a held lock's own connection. The simulated training
service keeps its own table (training_jobs), as an external system would.
``pipelines`` and ``step_history`` are guarded tables: Postgres itself refuses a
write to a tenant's rows from a session that does not hold the tenant's lock.
"""

from __future__ import annotations

import psycopg

from pglock_celery import install_guard, wait_lock

#: The stages of one tenant's pipeline, in order; "stopped" halts a tenant.
STAGES = ("due", "training", "downloading", "evaluating")
STOPPED = "stopped"
TENANT_ID_MAX = 64
#: The lock of a tenant's pipeline: the steps' lock_name, and the guard of its tables.
PIPELINE_LOCK = "training:{tenant_id}"
GUARDED_TABLES = ("pipelines", "step_history")

DDL = f"""
CREATE TABLE IF NOT EXISTS tenants (
    tenant_id text PRIMARY KEY,
    created_at timestamptz NOT NULL DEFAULT now()
);
CREATE TABLE IF NOT EXISTS pipelines (
    tenant_id text PRIMARY KEY REFERENCES tenants ON DELETE CASCADE,
    stage text NOT NULL DEFAULT 'due',
    run_number integer NOT NULL DEFAULT 0,
    job_id bigint,
    next_due_at timestamptz NOT NULL DEFAULT now(),
    attempts integer NOT NULL DEFAULT 0,
    last_error text,
    model_version integer NOT NULL DEFAULT 0,
    model_score double precision,
    candidate_score double precision,
    completed_cycles integer NOT NULL DEFAULT 0,
    updated_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX IF NOT EXISTS pipelines_due ON pipelines (next_due_at) WHERE stage <> '{STOPPED}';
CREATE TABLE IF NOT EXISTS step_history (
    id bigserial PRIMARY KEY,
    tenant_id text NOT NULL,
    run_number integer NOT NULL,
    stage text NOT NULL,
    outcome text NOT NULL,
    worker text NOT NULL,
    worker_pid integer NOT NULL,
    session_pid integer NOT NULL,
    started_at timestamptz NOT NULL,
    finished_at timestamptz NOT NULL
);
CREATE INDEX IF NOT EXISTS step_history_tenant ON step_history (tenant_id, started_at);
CREATE TABLE IF NOT EXISTS onboarding_history (
    tenant_id text PRIMARY KEY,
    worker_pid integer NOT NULL,
    started_at timestamptz NOT NULL,
    finished_at timestamptz NOT NULL
);
CREATE TABLE IF NOT EXISTS training_jobs (
    job_id bigserial PRIMARY KEY,
    idempotency_key text NOT NULL UNIQUE,
    tenant_id text NOT NULL,
    run_number integer NOT NULL,
    submitted_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    ready_at timestamptz NOT NULL,
    failed boolean NOT NULL,
    score double precision NOT NULL,
    downloads integer NOT NULL DEFAULT 0
);
"""


def apply_schema(dsn: str) -> None:
    """Create the tables and their guards if missing; safe from several processes at once."""
    with wait_lock("orchestrator:schema", dsn=dsn, timeout=60) as lock:
        with lock.connection.transaction():
            lock.connection.execute(DDL)
            for table in GUARDED_TABLES:
                install_guard(lock.connection, table, PIPELINE_LOCK)


def reset_schema(dsn: str) -> None:
    """Drop every orchestrator table (for a clean `make run`)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "DROP TABLE IF EXISTS step_history, onboarding_history, training_jobs,"
            " pipelines, tenants"
        )
