"""Production settings: the base ones, then the lock database named by its alias."""

from .base import *  # noqa: F403

CELERY_PGLOCK_DATABASE = "default"
