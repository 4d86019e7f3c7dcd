"""System checks of a project's pglock settings (``manage.py check``).

- ``pglock.E001``: no lock database (``CELERY_PGLOCK_DATABASE``, ``CELERY_PGLOCK_DSN`` or
  ``PGLOCK_DSN``);
- ``pglock.E002``: a lock DSN that is malformed, or a ``pglock_database`` whose
  ``DATABASES`` entry gives none;
- ``pglock.E003``: any other invalid pglock setting;
- ``pglock.E004``: ``pglock_pooler = "transaction"``: session locks do not survive a
  transaction-mode pooler;
- ``pglock.E005``: a ``TenantLockedTask`` option of the project's Celery app that the
  worker would refuse at start (a ``lock_name`` naming no argument of its task, a bad
  ``lock_mode``, ``lock_timeout`` or ``lock_retry_countdown``);
- ``pglock.W001``: the locks reach ``DATABASES[alias]``, which sets
  ``DISABLE_SERVER_SIDE_CURSORS`` (what Django asks behind a transaction-mode pooler).

No message shows a password. Nothing connects: a check reads settings, and imports the
task modules of the project's Celery app as its worker does.
"""

from __future__ import annotations

import os
from typing import Any

from celery import current_app
from django.apps import apps  # type: ignore[import-untyped]
from django.conf import settings  # type: ignore[import-untyped]
from django.core import checks  # type: ignore[import-untyped]

from ..config import load_config, setting_name
from ..exceptions import ConfigurationError
from ..task import TenantLockedTask
from . import dsn
from .celery_settings import settings_app

#: The tag of these checks (``manage.py check --tag pglock``).
TAG = "pglock"


def register() -> None:
    checks.register(check_pglock_settings, TAG)
    checks.register(check_task_options, TAG)


def check_task_options(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    """Every TenantLockedTask option a worker of the project's Celery app would refuse.

    The project's app is Celery's current one (its module, loaded with Django as Celery's
    guide does, made it current). Its task modules are imported as its worker finds them:
    each installed app's ``tasks`` module (``autodiscover_tasks()``), then ``imports`` and
    ``include``. (Not through the loader's ``import_default_modules``: Celery's Django
    fixup would set Django up again from inside the checks.)
    """
    app = current_app
    app.loader.autodiscover_tasks([config.name for config in apps.get_app_configs()])
    for module in app.loader.default_modules:
        app.loader.import_task_module(module)
    return [
        checks.Error(problem, id="pglock.E005")
        for task in app.tasks.values()
        if isinstance(task, TenantLockedTask)
        for problem in task.configuration_problems()
    ]


def _raw(conf: Any, name: str) -> Any:
    """A setting as written: in Django's settings, else its environment variable."""
    value = conf.get(f"pglock_{name}")
    if value is None:
        value = os.environ.get(f"PGLOCK_{name.upper()}") or None
    return value


def check_pglock_settings(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    """Every problem of the pglock settings that a worker would refuse to start with.

    Each names a setting as the project wrote it (``CELERY_PGLOCK_POOLER`` in Django's
    settings, ``PGLOCK_POOLER`` in the environment), as the worker's errors do.
    """
    conf = settings_app().conf

    def _written(name: str) -> str:
        return setting_name(conf, name)

    pooler = _raw(conf, "pooler")
    if isinstance(pooler, str) and pooler.strip().lower() == "transaction":
        return [
            checks.Error(
                f"{_written('pooler')} = 'transaction': a session advisory lock does not "
                "survive a transaction-mode pooler (another client gets the backend that "
                "holds it)",
                hint="reach Postgres directly for the locks (a DATABASES alias that connects "
                f"directly in {_written('database')}, or {_written('dsn')}), or through a "
                f"session-mode pool with {_written('pooler')} = 'session'",
                id="pglock.E004",
            )
        ]
    alias = _raw(conf, "database")
    if isinstance(alias, str) and alias:
        try:
            dsn(alias)
        except ConfigurationError as exc:
            return [
                checks.Error(
                    f"{_written('database')} = {alias!r} gives no lock DSN: {exc}",
                    id="pglock.E002",
                )
            ]
    try:
        config = load_config(conf)
    except ConfigurationError as exc:
        return [checks.Error(str(exc), id="pglock.E003")]
    try:
        config.require_dsn()
    except ConfigurationError as exc:
        missing = config.dsn is None
        return [
            checks.Error(
                str(exc),
                hint=f"set {_written('database')} to the DATABASES alias of the lock database"
                if missing
                else None,
                id="pglock.E001" if missing else "pglock.E002",
            )
        ]
    if config.database is not None and _raw(conf, "dsn") is None:
        entry = settings.DATABASES[config.database]
        if entry.get("DISABLE_SERVER_SIDE_CURSORS"):
            return [
                checks.Warning(
                    f"the locks reach DATABASES[{config.database!r}], which sets "
                    "DISABLE_SERVER_SIDE_CURSORS, as Django asks behind a transaction-mode "
                    "pooler: session locks do not survive one",
                    hint=f"name an alias that connects directly in {_written('database')}",
                    id="pglock.W001",
                )
            ]
    return []
