"""The orchestrator: multi-tenant retraining pipelines over several worker replicas.

`celery -A tasks worker` / `celery -A tasks beat` load this package.
"""

from __future__ import annotations

from . import pipeline, tenants
from .celery_app import app

__all__ = ["app", "pipeline", "tenants"]
