"""A configuration error names each setting as the project wrote it.

Under ``config_from_object(..., namespace="CELERY")`` (Celery's Django guide) a project
writes ``CELERY_PGLOCK_DSN``; under ``namespace="PROJ"`` ``PROJ_PGLOCK_DSN``; without a
namespace ``pglock_dsn``; in the environment ``PGLOCK_DSN``. Every setting an error names
is named the way its value came (or, unset, the way the project would write it), and no
message shows a DSN's password. ``pglock_database`` without Django installed is a
ConfigurationError saying to install it.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import django
import pytest
from celery import Celery
from django.conf import settings

from pglock_celery import ConfigurationError, TenantLockedTask
from pglock_celery.config import SETTINGS, get_config
from pglock_celery.patroni import LeaderFence, Timing
from pglock_celery.task import configuration_problems
from tests.support.workers import ROOT

PASSWORD = "s3cret-names-pw"

#: namespace -> how the project writes the key of setting ``x``.
NAMESPACES: dict[str | None, str] = {
    None: "pglock_{}",
    "CELERY": "CELERY_PGLOCK_{}",
    "PROJ": "PROJ_PGLOCK_{}",
}

_KEYS = frozenset(key for key, _env, _default in SETTINGS)
_TOKEN = re.compile(r"\b(?:[A-Za-z0-9]+_)?pglock_[a-z_]+\b", re.IGNORECASE)


def named(message: str) -> set[str]:
    """Every name of a pglock setting in ``message``, as the message writes it."""
    found = set()
    for token in _TOKEN.findall(message):
        bare = token.lower()
        bare = bare[bare.index("pglock_") :]
        if bare in _KEYS:
            found.add(token)
    return found


def written(namespace: str | None, setting: str) -> str:
    pattern = NAMESPACES[namespace]
    return pattern.format(setting.upper() if namespace else setting)


def app_with(namespace: str | None, **values: Any) -> Celery:
    """An app configured from an object holding ``values`` under ``namespace``."""
    app = Celery("names", set_as_current=False)
    conf = {written(namespace, name): value for name, value in values.items()}
    app.config_from_object(conf, namespace=namespace)
    return app


def error(app: Celery, *, dsn: bool = False) -> str:
    """The ConfigurationError the app's settings give (at the first lock with ``dsn``)."""
    with pytest.raises(ConfigurationError) as raised:
        get_config(app).require_dsn() if dsn else get_config(app)
    return str(raised.value)


@pytest.fixture(autouse=True)
def no_pglock_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    for _key, env, _default in SETTINGS:
        monkeypatch.delenv(env, raising=False)


@pytest.fixture
def databases(monkeypatch: pytest.MonkeyPatch) -> None:
    """Django configured in-process once (another module may have done it), one alias."""
    if not settings.configured:
        settings.configure()
        django.setup()
    entry = {"ENGINE": "django.db.backends.postgresql", "NAME": "shop", "PASSWORD": PASSWORD}
    monkeypatch.setattr(settings, "DATABASES", {"default": entry})


SPACES = pytest.mark.parametrize("namespace", list(NAMESPACES), ids=["none", "CELERY", "PROJ"])


@SPACES
def test_a_malformed_dsn_is_named_as_written(namespace: str | None) -> None:
    app = app_with(namespace, dsn=f"postgresql://app:{PASSWORD}/7Zq@db/app")
    message = error(app, dsn=True)
    assert "not a valid connection string" in message
    assert named(message) == {written(namespace, "dsn")}, message
    assert PASSWORD not in message and "7Zq" not in message


def test_a_malformed_dsn_from_the_environment_is_named_as_the_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PGLOCK_DSN", f"host=db port=x5432 password={PASSWORD}")
    message = error(app_with("CELERY"), dsn=True)
    assert "not a valid connection string" in message
    assert named(message) == {"PGLOCK_DSN"}, message
    assert PASSWORD not in message


@SPACES
def test_no_lock_database_names_the_settings_the_project_would_write(
    namespace: str | None,
) -> None:
    message = error(app_with(namespace), dsn=True)
    assert message.startswith("no lock database configured")
    assert named(message) == {
        written(namespace, "dsn"),
        "PGLOCK_DSN",
        written(namespace, "database"),
    }, message


@SPACES
def test_two_settings_that_exclude_each_other_are_named_as_written(
    namespace: str | None,
) -> None:
    app = app_with(namespace, shards={"a": "dbname=a"}, dsn=f"dbname=b password={PASSWORD}")
    message = error(app)
    assert named(message) == {written(namespace, "shards"), written(namespace, "dsn")}, message
    assert PASSWORD not in message


@SPACES
def test_a_shard_rule_without_shards_is_named_as_written(namespace: str | None) -> None:
    message = error(app_with(namespace, shard_rule="os.path:basename"))
    assert named(message) == {written(namespace, "shard_rule"), written(namespace, "shards")}


@SPACES
def test_a_shard_rule_placing_on_an_unknown_shard_is_named_as_written(
    namespace: str | None,
) -> None:
    app = app_with(namespace, shards={"a": "dbname=a"}, shard_rule="os.path:basename")
    config = get_config(app)
    with pytest.raises(ConfigurationError) as raised:
        config.shard_of(1, "nowhere")
    message = str(raised.value)
    assert named(message) == {written(namespace, "shard_rule"), written(namespace, "shards")}


@SPACES
def test_pglock_database_under_the_shared_strategy_is_named_as_written(
    namespace: str | None,
) -> None:
    message = error(app_with(namespace, database="default", strategy="shared"))
    assert named(message) == {written(namespace, "database"), written(namespace, "strategy")}


def test_a_setting_from_the_environment_is_named_as_the_variable_beside_one_from_the_app(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PGLOCK_DATABASE", "default")
    message = error(app_with("PROJ", strategy="shared"))
    assert named(message) == {"PGLOCK_DATABASE", "PROJ_PGLOCK_STRATEGY"}, message


def test_a_plain_key_under_a_namespace_is_named_as_written() -> None:
    """Celery reads ``pglock_strategy`` under namespace PROJ too: named so."""
    app = Celery("names", set_as_current=False)
    app.config_from_object(
        {"PROJ_PGLOCK_DATABASE": "default", "pglock_strategy": "shared"}, namespace="PROJ"
    )
    assert named(error(app)) == {"PROJ_PGLOCK_DATABASE", "pglock_strategy"}


@SPACES
@pytest.mark.usefixtures("databases")
def test_an_unknown_alias_is_named_as_written(namespace: str | None) -> None:
    message = error(app_with(namespace, database="replica"))
    assert "no alias 'replica'" in message
    assert named(message) == {written(namespace, "database")}, message
    assert PASSWORD not in message


@SPACES
@pytest.mark.usefixtures("databases")
def test_a_dsn_of_another_database_than_the_alias_is_named_as_written(
    namespace: str | None,
) -> None:
    message = error(app_with(namespace, database="default", dsn="dbname=billing"))
    assert "'billing'" in message and "'shop'" in message
    assert named(message) == {written(namespace, "dsn"), written(namespace, "database")}
    assert PASSWORD not in message


@SPACES
def test_a_patroni_key_without_its_certificate_is_named_as_written(
    namespace: str | None, tmp_path: Path
) -> None:
    key = tmp_path / "client.key"
    key.write_text("not read\n")
    message = error(app_with(namespace, patroni_keyfile=str(key)))
    assert named(message) == {
        written(namespace, "patroni_keyfile"),
        written(namespace, "patroni_certfile"),
    }, message


WITHOUT_DJANGO = """
import importlib.abc, json, os, sys

class NoDjango(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "django" or name.startswith("django."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, NoDjango())
from celery import Celery
from pglock_celery import ConfigurationError, TenantLockedTask
from pglock_celery.config import get_config
from pglock_celery.task import configuration_problems

namespace = os.environ.get("NAMESPACE") or None
app = Celery("djangoless", set_as_current=False)
app.config_from_object(json.loads(os.environ["SETTINGS"]), namespace=namespace)

@app.task(base=TenantLockedTask)
def step(tenant_id):
    return tenant_id

try:
    get_config(app)
except ConfigurationError as exc:
    raised = ["ConfigurationError", str(exc)]
except BaseException as exc:
    raised = [type(exc).__name__, str(exc)]
else:
    raised = None
print(json.dumps({"raised": raised, "problems": configuration_problems(app)}))
"""


def without_django(namespace: str | None, conf: dict[str, str], **env: str) -> dict[str, Any]:
    """What the configuration gives in an interpreter where ``import django`` fails."""
    done = subprocess.run(
        [sys.executable, "-c", WITHOUT_DJANGO],
        cwd=ROOT,
        env={
            **{k: v for k, v in os.environ.items() if not k.startswith("PGLOCK_")},
            "PYTHONPATH": str(ROOT),
            "NAMESPACE": namespace or "",
            "SETTINGS": json.dumps(conf),
            **env,
        },
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    result: dict[str, Any] = json.loads(done.stdout)
    return result


@SPACES
def test_pglock_database_without_django_says_to_install_it_naming_the_setting(
    namespace: str | None,
) -> None:
    name = written(namespace, "database")
    result = without_django(namespace, {name: "default"})
    assert result["raised"] is not None and result["raised"][0] == "ConfigurationError", result
    message = result["raised"][1]
    assert "pip install django" in message, message
    assert named(message) <= {name, written(namespace, "dsn")} and name in named(message)
    assert result["problems"] == [message]


def test_pglock_database_from_the_environment_without_django_names_the_variable() -> None:
    result = without_django("CELERY", {}, PGLOCK_DATABASE="default")
    assert result["raised"] is not None and result["raised"][0] == "ConfigurationError", result
    assert "pip install django" in result["raised"][1]
    assert "PGLOCK_DATABASE" in named(result["raised"][1])
    assert result["problems"] == [result["raised"][1]]


@SPACES
def test_a_patroni_timing_too_short_at_worker_start_is_named_as_written(
    namespace: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Patroni's answer (GET /config: ttl 26, loop_wait 10) stands in for a cluster's."""
    monkeypatch.setattr(
        LeaderFence, "read_timing", lambda self: Timing(ttl=26, loop_wait=10, retry_timeout=5)
    )
    app = app_with(namespace, dsn="dbname=locks", patroni_url="http://127.0.0.1:1")

    @app.task(base=TenantLockedTask, shared=False)
    def step(tenant_id: int) -> None:
        return None

    [problem] = configuration_problems(app)
    assert "raise ttl to at least" in problem, problem
    assert named(problem) == {written(namespace, "patroni_url")}, problem


@SPACES
def test_a_shards_patroni_timing_too_short_names_the_shard_map_as_written(
    namespace: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(
        LeaderFence, "read_timing", lambda self: Timing(ttl=26, loop_wait=10, retry_timeout=5)
    )
    shards = {"a": {"dsn": "dbname=a", "patroni_url": "http://127.0.0.1:1"}}
    app = app_with(namespace, shards=shards)

    @app.task(base=TenantLockedTask, shared=False)
    def step(tenant_id: int) -> None:
        return None

    [problem] = configuration_problems(app)
    assert "shard 'a'" in problem and "raise ttl to at least" in problem, problem
    assert named(problem) == {written(namespace, "shards")}, problem


@pytest.mark.usefixtures("databases")
@pytest.mark.parametrize("where", ["settings", "environment"])
def test_a_system_check_names_a_setting_where_the_project_set_it(
    where: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """manage.py check: CELERY_PGLOCK_POOLER in Django's settings, PGLOCK_POOLER in the
    environment, each named so in the error and its hint."""
    from django.test import override_settings

    from pglock_celery.django.checks import check_pglock_settings

    if where == "environment":
        monkeypatch.setenv("PGLOCK_POOLER", "transaction")
        name = "PGLOCK_POOLER"
    else:
        monkeypatch.setattr(settings, "CELERY_PGLOCK_POOLER", "transaction", raising=False)
        name = "CELERY_PGLOCK_POOLER"
    with override_settings(CELERY_PGLOCK_DSN="dbname=shop"):
        [error] = check_pglock_settings()
    assert error.id == "pglock.E004"
    assert named(error.msg) == {name}, error.msg
    assert name in named(error.hint) and "CELERY_PGLOCK_DSN" in named(error.hint), error.hint


@pytest.mark.usefixtures("databases")
def test_a_system_check_names_an_alias_from_the_environment_as_the_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from pglock_celery.django.checks import check_pglock_settings

    monkeypatch.setenv("PGLOCK_DATABASE", "replica")
    [error] = check_pglock_settings()
    assert error.id == "pglock.E002"
    assert named(error.msg) == {"PGLOCK_DATABASE"}, error.msg
    assert PASSWORD not in error.msg
