"""Django: the lock database from ``DATABASES``, the ORM's writes fenced, checks, commands.

::

    # settings.py
    INSTALLED_APPS = [..., "pglock_celery.django"]
    CELERY_PGLOCK_DATABASE = "default"

``pglock_database`` names the alias whose settings give the lock's connection,
read when the settings are first needed (never at import: split settings work);
a task body's ORM writes to it then commit only while its lock is held
(fence.py). The app adds system checks (checks.py) and ``manage.py pglock``.
``dsn(alias)`` gives the DSN as a string for those who want it.

Nothing outside this package imports Django.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import psycopg
from django.conf import settings  # type: ignore[import-untyped]
from django.core.exceptions import ImproperlyConfigured  # type: ignore[import-untyped]
from psycopg.conninfo import make_conninfo

from ..exceptions import ConfigurationError

#: Django's PostgreSQL backends end with one of these module names (the built-in
#: ``django.db.backends.postgresql``, its old ``postgresql_psycopg2`` name, GeoDjango's
#: ``postgis``); wrappers of them (``django_prometheus.db.backends.postgresql``) too.
_POSTGRES_ENGINES = ("postgresql", "postgresql_psycopg2", "postgis", "postgresql_backend")


def _libpq_keywords() -> frozenset[str]:
    """Every connection parameter the loaded libpq knows (host, sslmode, options...)."""
    return frozenset(option.keyword.decode() for option in psycopg.pq.Conninfo.get_defaults())


def _text(value: Any) -> str:
    if isinstance(value, bool):  # libpq's switches (keepalives, ...) are 1 or 0
        return "1" if value else "0"
    return str(value)


def time_zone(alias: str) -> str:
    """The time zone Django sets on the connections of ``alias`` (its backend's
    ``timezone_name``): ``TIME_ZONE`` without ``USE_TZ``, else the alias's own
    ``TIME_ZONE``, else UTC (empty: Django sets none)."""
    if not settings.USE_TZ:
        return str(settings.TIME_ZONE or "")
    own = settings.DATABASES[alias].get("TIME_ZONE")
    return "UTC" if own is None else str(own)


def dsn(alias: str = "default") -> str:
    """Return a libpq connection string for ``settings.DATABASES[alias]``.

    Built the way Django's PostgreSQL backend connects: ``NAME`` (``None``: the
    ``postgres`` database), ``USER``, ``PASSWORD`` (any characters, quoted as
    libpq wants), ``HOST`` (absent or empty: libpq's default, the Unix socket)
    and ``PORT`` (empty, an int or a str), then each ``OPTIONS`` entry that is a
    libpq parameter (``sslmode``, ``options``, ``service``, ``passfile``...).
    Options that are Django's or psycopg's own (``isolation_level``, ``pool``,
    ``assume_role``, ``server_side_binding``, ``cursor_factory``...) are left out.

    Raises ``ConfigurationError`` naming the alias when it is not in
    ``DATABASES``, is not a PostgreSQL database, or cannot make a connection
    string; the message never shows the password.
    """
    try:
        databases: Mapping[str, Any] = settings.DATABASES
    except ImproperlyConfigured:
        raise ConfigurationError(
            "Django's settings are not configured (DJANGO_SETTINGS_MODULE): "
            f"the lock DSN of DATABASES[{alias!r}] cannot be read"
        ) from None
    if alias not in databases:
        known = ", ".join(sorted(map(repr, databases))) or "none"
        raise ConfigurationError(
            f"DATABASES has no alias {alias!r} (its aliases: {known}); "
            "pglock_celery.django.dsn() needs the alias of a PostgreSQL database"
        )
    entry: Mapping[str, Any] = databases[alias]
    engine = str(entry.get("ENGINE") or "")
    if engine.rsplit(".", 1)[-1] not in _POSTGRES_ENGINES:
        raise ConfigurationError(
            f"DATABASES[{alias!r}] is not a PostgreSQL database (ENGINE {engine!r}): "
            "advisory locks need PostgreSQL"
        )
    keywords = _libpq_keywords()
    params: dict[str, str] = {
        key: _text(value)
        for key, value in (entry.get("OPTIONS") or {}).items()
        if key in keywords and value is not None
    }
    name = entry.get("NAME")
    if name is None:
        params.setdefault("dbname", "postgres")  # what Django connects to without a NAME
    elif name != "":
        params["dbname"] = str(name)
    for setting, keyword in (("USER", "user"), ("PASSWORD", "password"), ("HOST", "host")):
        value = entry.get(setting)
        if value not in (None, ""):
            params[keyword] = str(value)
    port = entry.get("PORT")
    if port not in (None, ""):
        params["port"] = str(port)
    for keyword, value in params.items():
        if "\x00" in value:  # libpq would cut the value there
            raise ConfigurationError(
                f"DATABASES[{alias!r}]: the value of {keyword!r} holds a NUL character "
                "(the value is not shown)"
            )
    try:
        return make_conninfo("", **params)
    except (psycopg.Error, ValueError, TypeError) as exc:
        # Their text may quote a value, the password among them.
        raise ConfigurationError(
            f"DATABASES[{alias!r}] does not make a libpq connection string "
            f"({type(exc).__name__}; the values are not shown)"
        ) from None
