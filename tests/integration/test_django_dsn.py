"""pglock_celery.django.dsn() turns every valid DATABASES entry into a DSN that connects."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import django
import psycopg
import pytest
from django.conf import settings
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict

from pglock_celery import ConfigurationError, try_lock
from pglock_celery.django import dsn
from tests.support.services import EmbeddedPostgres

#: Every character libpq's quoting cares about: spaces, quotes, backslashes, '='.
AWKWARD_PASSWORD = "p w'd\\x=\"y\\' ='\\\\ end"

ENGINE = "django.db.backends.postgresql"


@pytest.fixture(scope="module", autouse=True)
def django_settings() -> None:
    """Django configured in-process once (another test module may have done it)."""
    if not settings.configured:
        settings.configure()
        django.setup()


@pytest.fixture
def server(pg_dsn: str) -> dict[str, str]:
    """The test database's host, port, name and user, as libpq parsed them."""
    params = conninfo_to_dict(pg_dsn)
    return {
        "host": str(params.get("host") or "127.0.0.1"),
        "port": str(params.get("port") or "5432"),
        "dbname": str(params["dbname"]),
        "user": str(params.get("user") or "postgres"),
    }


def databases(monkeypatch: pytest.MonkeyPatch, **entries: dict[str, Any]) -> None:
    monkeypatch.setattr(settings, "DATABASES", entries)


def connected(conninfo: str) -> tuple[Any, ...]:
    """What the server says about a session opened with ``conninfo``."""
    with psycopg.connect(conninfo, connect_timeout=5) as conn:
        row = conn.execute(
            "SELECT current_database(), current_user, inet_server_addr() IS NULL,"
            " current_setting('search_path'), current_setting('application_name')"
        ).fetchone()
    assert row is not None
    return tuple(row)


def test_an_empty_port_is_left_to_libpq(
    monkeypatch: pytest.MonkeyPatch, server: dict[str, str]
) -> None:
    """PORT '' (most Django projects): no `port=` in the DSN, libpq's default applies."""
    databases(
        monkeypatch,
        default={
            "ENGINE": ENGINE, "NAME": server["dbname"], "USER": server["user"],
            "PASSWORD": "", "HOST": server["host"], "PORT": "",
        },
    )  # fmt: skip
    monkeypatch.setenv("PGPORT", server["port"])  # libpq's default port, for this server
    built = dsn()
    assert "port" not in conninfo_to_dict(built)
    assert connected(built)[:2] == (server["dbname"], server["user"])


@pytest.mark.parametrize("port", [int, str], ids=["int", "str"])
def test_a_port_given_as_int_or_str(
    monkeypatch: pytest.MonkeyPatch, server: dict[str, str], port: type
) -> None:
    databases(
        monkeypatch,
        other={
            "ENGINE": ENGINE, "NAME": server["dbname"], "USER": server["user"],
            "HOST": server["host"], "PORT": port(server["port"]),
        },
    )  # fmt: skip
    monkeypatch.delenv("PGPORT", raising=False)
    built = dsn("other")
    assert conninfo_to_dict(built)["port"] == server["port"]
    assert connected(built)[0] == server["dbname"]


def test_no_host_connects_over_the_unix_socket(
    monkeypatch: pytest.MonkeyPatch, server: dict[str, str]
) -> None:
    """An entry without HOST (the key absent, as Django allows): libpq's Unix socket."""
    with psycopg.connect(conninfo(server), autocommit=True) as conn:
        row = conn.execute("SELECT current_setting('unix_socket_directories')").fetchone()
    assert row is not None
    socket_dirs = [part.strip() for part in str(row[0]).split(",") if part.strip()]
    assert socket_dirs, "the server listens on no Unix socket"
    databases(
        monkeypatch,
        default={"ENGINE": ENGINE, "NAME": server["dbname"], "USER": server["user"]},
    )
    # libpq's compiled-in socket directory (/var/run/postgresql on Debian) unless the
    # server's socket is elsewhere (an embedded test server): then PGHOST, as a user would.
    monkeypatch.delenv("PGHOST", raising=False)
    if "/var/run/postgresql" not in socket_dirs:
        monkeypatch.setenv("PGHOST", socket_dirs[0])
    monkeypatch.setenv("PGPORT", server["port"])
    built = dsn()
    assert "host" not in conninfo_to_dict(built)
    database, user, over_socket, *_ = connected(built)
    assert (database, user, over_socket) == (server["dbname"], server["user"], True)


def conninfo(server: dict[str, str]) -> str:
    return " ".join(f"{key}={value}" for key, value in server.items())


def test_options_that_are_libpq_parameters_are_passed_on(
    monkeypatch: pytest.MonkeyPatch, server: dict[str, str]
) -> None:
    """sslmode, options, application_name reach libpq; Django's own options do not."""
    databases(
        monkeypatch,
        default={
            "ENGINE": ENGINE, "NAME": server["dbname"], "USER": server["user"],
            "HOST": server["host"], "PORT": server["port"],
            "OPTIONS": {
                "sslmode": "disable",
                "options": "-c search_path=pglock_a,pglock_b",
                "application_name": "django app",
                "keepalives": True,
                "isolation_level": 2,  # Django's, not libpq's
                "pool": False,  # Django's connection pool switch
                "server_side_binding": True,
                "assume_role": "nobody",
            },
        },
    )  # fmt: skip
    built = dsn()
    params = conninfo_to_dict(built)
    assert params["sslmode"] == "disable" and params["keepalives"] == "1"
    for django_only in ("isolation_level", "pool", "server_side_binding", "assume_role"):
        assert django_only not in params
    *_, search_path, application_name = connected(built)
    assert search_path == "pglock_a,pglock_b"
    assert application_name == "django app"


@pytest.fixture
def awkward_role(server: dict[str, str]) -> Iterator[str]:
    """A throwaway login role whose password has every character libpq quotes."""
    name = f"pglock_dj_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(conninfo(server), autocommit=True) as conn:
        conn.execute(
            sql.SQL("CREATE ROLE {} LOGIN PASSWORD {}").format(
                sql.Identifier(name), sql.Literal(AWKWARD_PASSWORD)
            )
        )
    try:
        yield name
    finally:
        with psycopg.connect(conninfo(server), autocommit=True) as conn:
            conn.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(name)))


def test_a_password_with_any_characters_comes_through_exactly(
    monkeypatch: pytest.MonkeyPatch, server: dict[str, str], awkward_role: str
) -> None:
    """The DSN parses back to the exact password, connects as the role, and a lock works."""
    databases(
        monkeypatch,
        default={
            "ENGINE": ENGINE, "NAME": server["dbname"], "USER": awkward_role,
            "PASSWORD": AWKWARD_PASSWORD, "HOST": server["host"], "PORT": int(server["port"]),
        },
    )  # fmt: skip
    built = dsn()
    params = conninfo_to_dict(built)
    assert params["password"] == AWKWARD_PASSWORD
    assert params["user"] == awkward_role
    assert connected(built)[:2] == (server["dbname"], awkward_role)
    with try_lock(f"django-dsn:{awkward_role}", dsn=built) as lock:
        assert lock.acquired


def test_the_password_is_checked_by_a_server_that_asks_for_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """On a server with SCRAM over TCP the awkward password logs in, a wrong one does not."""
    server = EmbeddedPostgres(tmp_path / "scram")
    server.init(password=AWKWARD_PASSWORD)
    server.start()
    try:
        entry = {
            "ENGINE": ENGINE, "NAME": "postgres", "USER": "postgres",
            "PASSWORD": AWKWARD_PASSWORD, "HOST": "127.0.0.1", "PORT": server.port,
        }  # fmt: skip
        databases(monkeypatch, default=entry, wrong={**entry, "PASSWORD": "p w'd"})
        monkeypatch.delenv("PGPASSWORD", raising=False)
        monkeypatch.setenv("PGPASSFILE", str(tmp_path / "no-passfile"))
        assert connected(dsn())[:2] == ("postgres", "postgres")
        with pytest.raises(psycopg.OperationalError, match="password authentication failed"):
            connected(dsn("wrong"))
    finally:
        server.destroy()


def test_an_unknown_alias_is_named_without_the_password(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    databases(
        monkeypatch,
        default={"ENGINE": ENGINE, "NAME": "app", "PASSWORD": AWKWARD_PASSWORD},
    )
    with pytest.raises(ConfigurationError) as raised:
        dsn("replica")
    message = str(raised.value)
    assert "'replica'" in message and "'default'" in message
    assert AWKWARD_PASSWORD not in message and "p w'd" not in message


def test_a_database_that_is_not_postgres_is_refused_naming_its_engine(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    databases(
        monkeypatch,
        default={"ENGINE": ENGINE, "NAME": "app"},
        legacy={
            "ENGINE": "django.db.backends.mysql",
            "NAME": "shop",
            "USER": "shop",
            "PASSWORD": AWKWARD_PASSWORD,
        },
    )
    with pytest.raises(ConfigurationError) as raised:
        dsn("legacy")
    message = str(raised.value)
    assert "'legacy'" in message and "django.db.backends.mysql" in message
    assert "PostgreSQL" in message
    assert AWKWARD_PASSWORD not in message and "p w'd" not in message


def test_a_nul_in_a_value_is_refused_without_showing_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """libpq would cut the password at the NUL and log in with a shorter one."""
    databases(
        monkeypatch,
        default={"ENGINE": ENGINE, "NAME": "app", "PASSWORD": "secret\x00tail"},
    )
    with pytest.raises(ConfigurationError) as raised:
        dsn()
    message = str(raised.value)
    assert "'password'" in message and "NUL" in message
    assert "secret" not in message and "tail" not in message
