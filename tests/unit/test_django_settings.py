"""pglock_database: parsed, resolved from DATABASES when the config is built, never at import."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import django
import psycopg
import pytest
from django.conf import settings
from psycopg import postgres
from psycopg.adapt import AdaptersMap, Loader

from pglock_celery import ConfigurationError
from pglock_celery.config import PglockConfig, load_config
from pglock_celery.django.fence import use_adapters
from pglock_celery.handles import dead_pgconn
from pglock_celery.session import connect_kwargs
from tests.support.workers import ROOT

PROJECT = ROOT / "tests" / "django_project"
AWKWARD_PASSWORD = "p w'd\\x=\"y ='end"
ENTRY = {"ENGINE": "django.db.backends.postgresql", "NAME": "shop", "USER": "shop"}


@pytest.fixture(autouse=True)
def databases(monkeypatch: pytest.MonkeyPatch) -> None:
    """Django configured in-process once (another module may have done it), one alias."""
    if not settings.configured:
        settings.configure()
        django.setup()
    monkeypatch.setattr(settings, "DATABASES", {"default": {**ENTRY, "PASSWORD": "s3cret"}})
    monkeypatch.delenv("PGLOCK_DSN", raising=False)
    monkeypatch.delenv("PGLOCK_DATABASE", raising=False)


@pytest.mark.parametrize("raw", [5, "", "   ", ["default"]], ids=["int", "empty", "blank", "list"])
def test_a_bad_pglock_database_is_refused_naming_the_setting(raw: Any) -> None:
    with pytest.raises(ConfigurationError, match=r"^invalid setting pglock_database="):
        load_config({"pglock_database": raw}, environ={})


def test_the_alias_gives_the_lock_dsn() -> None:
    config = load_config({"pglock_database": "default"}, environ={})
    assert config.database == "default"
    assert psycopg.conninfo.conninfo_to_dict(config.require_dsn()) == {
        "dbname": "shop",
        "user": "shop",
        "password": "s3cret",
    }


def test_the_environment_variable_names_an_alias_too() -> None:
    config = load_config({}, environ={"PGLOCK_DATABASE": "default"})
    assert config.database == "default" and "dbname=shop" in config.require_dsn()


def test_an_unknown_alias_is_an_error_naming_the_setting_without_the_password() -> None:
    with pytest.raises(ConfigurationError, match=r"pglock_database='replica'.*no alias") as err:
        load_config({"pglock_database": "replica"}, environ={})
    assert "s3cret" not in str(err.value)


def test_the_shared_strategy_is_refused_saying_which_strategies_fence() -> None:
    with pytest.raises(ConfigurationError, match=r"shared.*'reuse' or 'connect'"):
        load_config({"pglock_database": "default", "pglock_strategy": "shared"}, environ={})


def test_a_pglock_dsn_given_too_says_how_to_reach_the_same_database() -> None:
    direct = "host=db-direct.internal port=5432 dbname=shop user=shop"
    config = load_config({"pglock_database": "default", "pglock_dsn": direct}, environ={})
    assert config.require_dsn() == direct


def test_a_pglock_dsn_of_another_database_is_refused() -> None:
    with pytest.raises(ConfigurationError, match=r"'billing'.*'shop'.*one database"):
        load_config({"pglock_database": "default", "pglock_dsn": "dbname=billing"}, environ={})


def test_a_config_built_directly_resolves_the_alias_too() -> None:
    assert "dbname=shop" in PglockConfig(database="default").require_dsn()


def run_in_project(code: str, **env: str) -> str:
    """Run ``code`` in a fresh interpreter with the test project importable; its stdout."""
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=PROJECT,
        env={
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(PROJECT), str(ROOT)]),
            "PGLOCK_DSN": "",
            **env,
        },
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


SPLIT_SETTINGS = """
import django
from django.conf import settings
from psycopg.conninfo import conninfo_to_dict
import proj.settings.prod as prod   # the import alone reads no DATABASES entry
assert prod.CELERY_PGLOCK_DATABASE == "default"
django.setup()
from proj.celery import app
from pglock_celery.config import get_config
params = conninfo_to_dict(get_config(app).require_dsn())
print(sorted(params))
print(params["password"] == settings.DATABASES["default"]["PASSWORD"])
"""


def test_split_settings_with_no_host_an_empty_port_options_and_any_password() -> None:
    """prod.py imports base.py: the DSN comes from the finished DATABASES, once it is needed."""
    out = run_in_project(
        SPLIT_SETTINGS,
        DJANGO_SETTINGS_MODULE="proj.settings.prod",
        SHOP_DB_PASSWORD=AWKWARD_PASSWORD,
        SHOP_DB_HOST="",
        SHOP_DB_PORT="",
    )
    keys, same_password = out.splitlines()
    assert keys == "['application_name', 'connect_timeout', 'dbname', 'password', 'user']"
    assert same_password == "True"
    assert AWKWARD_PASSWORD not in out


def test_the_project_imports_with_an_alias_its_databases_lack() -> None:
    """Nothing is read at import: the error comes when the config is built, naming the setting."""
    code = (
        "import django; django.setup()\n"
        "from django.test import override_settings\n"
        "from proj.celery import app\n"
        "from pglock_celery import ConfigurationError\n"
        "from pglock_celery.config import get_config\n"
        "with override_settings(CELERY_PGLOCK_DATABASE='missing'):\n"
        "    try:\n"
        "        get_config(app)\n"
        "    except ConfigurationError as exc:\n"
        "        print(exc)\n"
    )
    out = run_in_project(code, DJANGO_SETTINGS_MODULE="proj.settings.prod")
    assert out.startswith(
        "invalid setting CELERY_PGLOCK_DATABASE='missing': DATABASES has no alias"
    )


class Marker(Loader):
    def load(self, data: Any) -> str:
        return "marker"


def test_psycopgs_adapters_attribute_is_still_where_the_fence_sets_it() -> None:
    """use_adapters relies on Connection._adapters: this fails when psycopg moves it."""
    connection = psycopg.Connection(dead_pgconn())
    template = AdaptersMap(postgres.adapters)
    template.register_loader("jsonb", Marker)
    use_adapters(connection, template)
    loader = connection.adapters.get_loader(postgres.types["jsonb"].oid, psycopg.pq.Format.TEXT)
    assert loader is Marker


@pytest.mark.parametrize(
    ("use_tz", "alias_zone", "zone"),
    [(True, None, "UTC"), (True, "Asia/Tokyo", "Asia/Tokyo"), (False, None, "Europe/Paris")],
    ids=["utc", "the-alias-own", "without-use-tz"],
)
def test_the_lock_session_starts_in_the_zone_django_gives_the_alias(
    monkeypatch: pytest.MonkeyPatch, use_tz: bool, alias_zone: str | None, zone: str
) -> None:
    """Django's own rule (BaseDatabaseWrapper.timezone_name), after the alias's options."""
    monkeypatch.setattr(settings, "USE_TZ", use_tz)
    monkeypatch.setattr(settings, "TIME_ZONE", "Europe/Paris")
    entry = {**ENTRY, "TIME_ZONE": alias_zone, "OPTIONS": {"options": "-c TimeZone=Etc/GMT+6"}}
    monkeypatch.setattr(settings, "DATABASES", {"default": entry})
    from django.db.utils import ConnectionHandler

    assert ConnectionHandler()["default"].timezone_name == zone  # Django's own reading
    options = str(connect_kwargs(load_config({"pglock_database": "default"}, {}), "x")["options"])
    assert options.startswith("-c TimeZone=Etc/GMT+6 ")
    assert options.endswith(f" -c TimeZone={zone}") or f" -c TimeZone={zone} " in options


def test_a_zone_with_a_space_is_escaped_as_libpq_reads_options(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(settings, "USE_TZ", True)
    monkeypatch.setattr(settings, "DATABASES", {"default": {**ENTRY, "TIME_ZONE": "a b\\c"}})
    options = str(connect_kwargs(load_config({"pglock_database": "default"}, {}), "x")["options"])
    assert "-c TimeZone=a\\ b\\\\c " in options + " "
