"""The Django app ``pglock_celery.django``: its system checks, and ``manage.py pglock``."""

from __future__ import annotations

from django.apps import AppConfig  # type: ignore[import-untyped]


class PglockAppConfig(AppConfig):  # type: ignore[misc]
    name = "pglock_celery.django"
    label = "pglock"
    verbose_name = "pglock-celery"

    def ready(self) -> None:
        from . import checks

        checks.register()
