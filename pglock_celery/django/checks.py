"""System checks of a project's pglock settings (``manage.py check``).

- ``pglock.E001``: no lock database (``CELERY_PGLOCK_DATABASE``, ``CELERY_PGLOCK_DSN`` or
  ``PGLOCK_DSN``);
- ``pglock.E002``: a lock DSN that is malformed, or a ``pglock_database`` whose
  ``DATABASES`` entry gives none;
- ``pglock.E003``: any other invalid pglock setting;
- ``pglock.E004``: ``pglock_pooler = "transaction"``: session locks do not survive a
  transaction-mode pooler;
- ``pglock.W001``: the locks reach ``DATABASES[alias]``, which sets
  ``DISABLE_SERVER_SIDE_CURSORS`` (what Django asks behind a transaction-mode pooler).

No message shows a password. Nothing connects: a check reads settings only.
"""

from __future__ import annotations

import os
from typing import Any

from django.conf import settings  # type: ignore[import-untyped]
from django.core import checks  # type: ignore[import-untyped]

from ..config import load_config
from ..exceptions import ConfigurationError
from . import dsn
from .celery_settings import NAMESPACE, settings_app

#: The tag of these checks (``manage.py check --tag pglock``).
TAG = "pglock"


def register() -> None:
    checks.register(check_pglock_settings, TAG)


def _raw(conf: Any, name: str) -> Any:
    """A setting as written: in Django's settings, else its environment variable."""
    value = conf.get(f"pglock_{name}")
    if value is None:
        value = os.environ.get(f"PGLOCK_{name.upper()}") or None
    return value


def _written(name: str) -> str:
    return f"{NAMESPACE}_PGLOCK_{name.upper()}"


def check_pglock_settings(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    """Every problem of the pglock settings that a worker would refuse to start with."""
    conf = settings_app().conf
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
