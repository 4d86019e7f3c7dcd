"""Celery settings of the orchestrator (the `tasks` app); each one overridable by env.

| variable                  | default                        |
| ------------------------- | ------------------------------ |
| ORCH_BROKER_URL           | redis://127.0.0.1:6379/0       |
| ORCH_RESULT_BACKEND       | the broker URL                 |
| PGLOCK_DSN                | host=127.0.0.1 dbname=postgres |
| PGLOCK_SHARDS             | none (shard name -> DSN, JSON; replaces PGLOCK_DSN) |
| ORCH_QUEUE                | pipelines                      |
| ORCH_SCAN_INTERVAL        | 5 (seconds between beat scans) |
| ORCH_SOFT_TIME_LIMIT      | 60 (seconds)                   |
| ORCH_TIME_LIMIT           | 90 (seconds)                   |
| ORCH_VISIBILITY_TIMEOUT   | 3600 (seconds; Redis redelivery) |
| ORCH_CYCLE_INTERVAL       | 60 (seconds from a cycle's end to the next) |
| ORCH_POLL_INTERVAL        | 5 (seconds between polls of a training job) |
| ORCH_TRAINING_SECONDS     | 20 (how long a simulated training job runs) |
| ORCH_TRAINING_FAILURE_RATE| 0.05 (share of simulated jobs that fail) |
| ORCH_STEP_SECONDS         | 0.05 (simulated work inside each step) |
| ORCH_DOWNLOAD_SECONDS     | 8 (fetching a trained model: longer than a scan interval) |
"""

from __future__ import annotations

import os

broker_url = os.environ.get("ORCH_BROKER_URL", "redis://127.0.0.1:6379/0")
result_backend = os.environ.get("ORCH_RESULT_BACKEND", broker_url)
result_expires = 3600
broker_connection_retry_on_startup = True
broker_transport_options = {
    "visibility_timeout": float(os.environ.get("ORCH_VISIBILITY_TIMEOUT", "3600")),
}

task_default_queue = os.environ.get("ORCH_QUEUE", "pipelines")
task_acks_late = True
task_reject_on_worker_lost = True
task_soft_time_limit = float(os.environ.get("ORCH_SOFT_TIME_LIMIT", "60"))
task_time_limit = float(os.environ.get("ORCH_TIME_LIMIT", "90"))
worker_prefetch_multiplier = 1
worker_send_task_events = True

# With shards each tenant lives in its lock's shard's database (tasks/shards.py), and
# pglock_dsn stays unset: the library refuses the two together.
pglock_shards = os.environ.get("PGLOCK_SHARDS") or None
pglock_dsn = (
    None if pglock_shards else os.environ.get("PGLOCK_DSN", "host=127.0.0.1 dbname=postgres")
)

beat_schedule = {
    "scan-due-tenants": {
        "task": "tasks.pipeline.scan_due_tenants",
        "schedule": float(os.environ.get("ORCH_SCAN_INTERVAL", "5")),
    },
}

# The pipeline's clock (seconds) and the simulated training service.
orchestrator_cycle_interval = float(os.environ.get("ORCH_CYCLE_INTERVAL", "60"))
orchestrator_poll_interval = float(os.environ.get("ORCH_POLL_INTERVAL", "5"))
orchestrator_training_seconds = float(os.environ.get("ORCH_TRAINING_SECONDS", "20"))
orchestrator_training_failure_rate = float(os.environ.get("ORCH_TRAINING_FAILURE_RATE", "0.05"))
orchestrator_step_seconds = float(os.environ.get("ORCH_STEP_SECONDS", "0.05"))
orchestrator_download_seconds = float(os.environ.get("ORCH_DOWNLOAD_SECONDS", "8"))
