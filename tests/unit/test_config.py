"""Settings: app.conf first, then PGLOCK_* environment variables, then defaults."""

from __future__ import annotations

import os
import subprocess
import sys
import timeit
import types
from pathlib import Path

import pytest
from celery import Celery

from pglock_celery import ConfigurationError
from pglock_celery.config import SETTINGS, PglockConfig, get_config, load_config


def test_defaults_without_any_setting() -> None:
    config = load_config({}, environ={})
    assert config == PglockConfig()
    assert config.dsn is None
    assert config.server_bound == 15.0
    assert config.client_bound < config.server_bound


def test_app_conf_wins_over_the_environment() -> None:
    config = load_config(
        {"pglock_dsn": "dbname=from_conf", "pglock_connect_timeout": 2},
        environ={"PGLOCK_DSN": "dbname=from_env", "PGLOCK_CONNECT_TIMEOUT": "9"},
    )
    assert config.dsn == "dbname=from_conf"
    assert config.connect_timeout == 2.0


def test_environment_is_the_fallback() -> None:
    config = load_config({}, environ={"PGLOCK_DSN": "dbname=x", "PGLOCK_REPORT_HOLDER": "no"})
    assert config.dsn == "dbname=x"
    assert config.report_holder is False


def test_a_bad_value_is_an_error_naming_the_variable() -> None:
    with pytest.raises(ConfigurationError, match="PGLOCK_CONNECT_TIMEOUT='soon'"):
        load_config({}, environ={"PGLOCK_CONNECT_TIMEOUT": "soon"})


def test_negative_interval_is_refused() -> None:
    with pytest.raises(ConfigurationError, match="greater than 0"):
        load_config({"pglock_server_keepalives_idle": -1}, environ={})


def test_application_name_prefix_may_not_hold_the_separator() -> None:
    with pytest.raises(ConfigurationError, match="without '\\|'"):
        load_config({"pglock_application_name": "a|b"}, environ={})


def test_missing_dsn_names_the_setting_and_the_variable() -> None:
    with pytest.raises(ConfigurationError, match=r"pglock_dsn.*PGLOCK_DSN"):
        PglockConfig().require_dsn()


def test_a_dsn_that_does_not_parse_cleanly_is_refused_without_being_quoted() -> None:
    config = PglockConfig(dsn="postgresql://postgres:Pw9x/7Zq@127.0.0.1:1/db")
    with pytest.raises(ConfigurationError, match="not a valid connection string") as raised:
        config.require_dsn()
    message = str(raised.value)
    assert "%2F" in message and "PGPASSWORD" in message
    assert "Pw9x" not in message and "7Zq" not in message


def test_config_is_cached_while_no_setting_changes() -> None:
    app = Celery("cfg", set_as_current=False)
    app.conf.pglock_dsn = "dbname=first"
    first = get_config(app)
    assert get_config(app) is first
    app.conf.broker_url = "memory://"  # not a pglock setting
    assert get_config(app) is first


def test_a_dsn_set_after_a_failed_call_counts_at_the_next_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("PGLOCK_DSN", raising=False)
    app = Celery("cfg", set_as_current=False)
    with pytest.raises(ConfigurationError, match="no lock database"):
        get_config(app).require_dsn()
    app.conf.pglock_dsn = "dbname=second"
    assert get_config(app).require_dsn() == "dbname=second"
    app.conf.update(pglock_check_interval=7, pglock_dsn="dbname=third")
    assert (get_config(app).dsn, get_config(app).check_interval) == ("dbname=third", 7.0)


def test_a_changed_config_module_counts_at_the_next_call(monkeypatch: pytest.MonkeyPatch) -> None:
    module = types.ModuleType("pglock_test_settings")
    module.pglock_dsn = "dbname=module"  # type: ignore[attr-defined]
    app = Celery("cfg", set_as_current=False)
    app.config_from_object(module)
    assert get_config(app).dsn == "dbname=module"
    monkeypatch.setattr(module, "pglock_dsn", "dbname=patched")
    assert get_config(app).dsn == "dbname=patched"


def test_a_changed_config_class_counts_at_the_next_call(monkeypatch: pytest.MonkeyPatch) -> None:
    class Settings:
        pglock_dsn = "dbname=class"

    app = Celery("cfg", set_as_current=False)
    app.config_from_object(Settings)
    assert get_config(app).on_lost == "interrupt"
    monkeypatch.setattr(Settings, "pglock_on_lost", "terminate", raising=False)
    assert get_config(app).on_lost == "terminate"


def test_a_changed_environment_variable_counts_at_the_next_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("PGLOCK_STRATEGY", raising=False)
    app = Celery("cfg", set_as_current=False)
    assert get_config(app).strategy == "reuse"
    monkeypatch.setenv("PGLOCK_STRATEGY", "connect")
    assert get_config(app).strategy == "connect"


def test_a_cached_lookup_costs_a_small_fraction_of_a_read() -> None:
    app = Celery("cfg", set_as_current=False)
    app.config_from_object(types.SimpleNamespace(pglock_dsn="dbname=x"))
    app.conf.pglock_check_interval = 3
    get_config(app)
    cached = min(timeit.repeat(lambda: get_config(app), number=200, repeat=5))
    read = min(timeit.repeat(lambda: load_config(app.conf), number=200, repeat=5))
    # About 60 times on an idle machine; 10 leaves room for a busy one.
    assert cached * 10 < read


class NamespacedSettings:
    """What Django's settings module looks like with namespace="CELERY"."""

    CELERY_BROKER_URL = "memory://"
    CELERY_PGLOCK_DSN = "dbname=from_django"
    CELERY_PGLOCK_CHECK_INTERVAL = "soon"


def test_bad_values_under_a_namespace_are_named_as_the_user_wrote_them() -> None:
    app = Celery("ns", set_as_current=False)
    app.config_from_object(NamespacedSettings, namespace="CELERY")
    app.conf.pglock_retry_countdown = "later"
    with pytest.raises(ConfigurationError) as raised:
        get_config(app)
    assert str(raised.value) == (
        "invalid settings: CELERY_PGLOCK_CHECK_INTERVAL='soon': could not convert string to"
        " float: 'soon'; pglock_retry_countdown='later': could not convert string to float:"
        " 'later'"
    )


def test_a_bad_dsn_value_is_never_shown(caplog: pytest.LogCaptureFixture) -> None:
    class Settings:
        CELERY_PGLOCK_DSN = b"host=h password=hunter2"

    app = Celery("ns", set_as_current=False)
    app.config_from_object(Settings, namespace="CELERY")
    with pytest.raises(
        ConfigurationError, match=r"^invalid setting CELERY_PGLOCK_DSN=<hidden>: "
    ) as raised:
        get_config(app)
    assert "hunter2" not in str(raised.value)
    assert "hunter2" not in caplog.text


@pytest.mark.parametrize("namespace", [None, "CELERY"])
def test_celery_masks_pglock_dsn_where_it_masks_secrets(namespace: str | None) -> None:
    key = "CELERY_PGLOCK_DSN" if namespace else "pglock_dsn"
    app = Celery("masked", set_as_current=False)
    app.config_from_object({key: "postgresql://u:hunter2@h/db"}, namespace=namespace)
    # The tables of `celery report` and `celery inspect conf`.
    assert app.conf.table()[key] == "********"
    assert "hunter2" not in app.conf.humanize(with_defaults=True)


def test_celery_report_masks_pglock_dsn(tmp_path: Path) -> None:
    (tmp_path / "reported.py").write_text(
        "from celery import Celery\n"
        "from pglock_celery import TenantLockedTask\n"
        "app = Celery('reported', broker='memory://')\n"
        "app.conf.pglock_dsn = 'postgresql://u:hunter2@h/db'\n"
    )
    done = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "reported", "report"],
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(tmp_path)},
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "pglock_dsn: '********'" in done.stdout
    assert "hunter2" not in done.stdout + done.stderr


def test_every_setting_has_a_prefixed_name_and_variable() -> None:
    for key, env, _default in SETTINGS:
        assert key.startswith("pglock_") and key.islower()
        assert env == key.upper()
