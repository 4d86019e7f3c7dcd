"""A Celery app with no settings of its own: the pglock settings come from PGLOCK_*."""

from __future__ import annotations

from celery import Celery

app = Celery("bare", set_as_current=False)
