"""The pglock settings of a Django project, read as its Celery app reads them.

Celery's Django guide configures the project's app with
``app.config_from_object("django.conf:settings", namespace="CELERY")``: the
system checks and ``manage.py pglock`` read the same place (``CELERY_PGLOCK_*``,
then the ``PGLOCK_*`` variables), without importing the project's Celery module.
"""

from __future__ import annotations

from celery import Celery

#: The namespace of Celery's Django guide.
NAMESPACE = "CELERY"


def settings_app() -> Celery:
    """A Celery app configured from Django's settings under ``CELERY_``, used for nothing else."""
    app = Celery("pglock-django", set_as_current=False, fixups=[])
    app.config_from_object("django.conf:settings", namespace=NAMESPACE)
    return app
