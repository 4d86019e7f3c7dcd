"""The orchestrator's Celery app, configured from celeryconfig.py."""

from __future__ import annotations

from celery import Celery

app = Celery("tasks")
app.config_from_object("celeryconfig")
