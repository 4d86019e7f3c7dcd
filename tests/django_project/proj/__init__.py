"""The project package: its Celery app is loaded with Django, as Celery's guide does."""

from .celery import app as celery_app

__all__ = ("celery_app",)
