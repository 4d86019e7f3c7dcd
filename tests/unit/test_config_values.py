"""Each pglock setting's parser: the values it takes, and the message for one it refuses."""

from __future__ import annotations

import re
import warnings
from typing import Any

import celery.app.utils
import pytest
from celery import Celery

from pglock_celery import ConfigurationError
from pglock_celery import config as config_module
from pglock_celery.config import PglockConfig, get_config, load_config


@pytest.mark.parametrize(
    ("name", "raw", "expected"),
    [
        ("connect_timeout", "2.5", 2.5),
        ("connect_timeout", 0.001, 0.001),
        ("application_name", "x" * 16, "x" * 16),
        ("application_name", "a", "a"),
        ("keepalives_idle", "1", 1),
        ("server_keepalives_count", 7, 7),
        ("on_lost", " Terminate ", "terminate"),
        ("on_lost", "RAISE", "raise"),
        ("on_lost", "interrupt", "interrupt"),
        ("strategy", " Connect ", "connect"),
        ("strategy", "REUSE", "reuse"),
        ("pooler", " Session ", "session"),
        ("pooler", "NONE", "none"),
        ("idle_sessions", "0", 0),
        ("idle_sessions", 3, 3),
        ("report_holder", False, False),
        ("report_holder", True, True),
        ("dsn", "dbname=x", "dbname=x"),
        ("dsn", "", None),
    ],
)
def test_a_good_value_is_taken(name: str, raw: Any, expected: Any) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        config = load_config({f"pglock_{name}": raw}, environ={})
    assert getattr(config, name) == expected


@pytest.mark.parametrize("raw", ["1", "true", "YES", " On "])
def test_every_spelling_of_true_is_true(raw: str) -> None:
    assert load_config({}, environ={"PGLOCK_REPORT_HOLDER": raw}).report_holder is True


@pytest.mark.parametrize("raw", ["0", "false", "No", " OFF "])
def test_every_spelling_of_false_is_false(raw: str) -> None:
    assert load_config({}, environ={"PGLOCK_REPORT_HOLDER": raw}).report_holder is False


@pytest.mark.parametrize(
    ("name", "raw", "why"),
    [
        ("connect_timeout", "0", "must be greater than 0"),
        ("connect_timeout", "-1.5", "must be greater than 0"),
        ("application_name", "", "must be 1 to 16 ASCII characters without '|'"),
        ("application_name", "é", "must be 1 to 16 ASCII characters without '|'"),
        ("application_name", "x" * 17, "must be 1 to 16 ASCII characters without '|'"),
        ("keepalives_idle", "0", "must be a whole number greater than 0"),
        ("on_lost", "ignore", "must be 'interrupt', 'raise' or 'terminate'"),
        ("on_lost", "kill", "must be 'interrupt', 'raise' or 'terminate'"),
        ("strategy", "pool", "must be 'connect', 'reuse' or 'shared'"),
        ("strategy", "pooled", "must be 'connect', 'reuse' or 'shared'"),
        ("pooler", "transaction", "must be 'none' or 'session'"),
        ("idle_sessions", "-1", "must be a whole number, 0 or more"),
        ("report_holder", "maybe", "must be true or false"),
    ],
)
def test_a_bad_value_is_an_error_naming_it_and_why(name: str, raw: Any, why: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an error, not a warning and a fallback
        with pytest.raises(ConfigurationError) as raised:
            load_config({f"pglock_{name}": raw}, environ={})
    assert str(raised.value) == f"invalid setting pglock_{name}={raw!r}: {why}"


def test_a_dsn_that_is_not_a_str_is_refused_without_being_shown() -> None:
    with pytest.raises(ConfigurationError) as raised:
        load_config({"pglock_dsn": 42}, environ={})
    assert str(raised.value) == (
        "invalid setting pglock_dsn=<hidden>: must be a libpq connection string (a str)"
    )


def test_a_bad_environment_value_is_named_as_the_variable() -> None:
    with pytest.raises(ConfigurationError) as raised:
        load_config({}, environ={"PGLOCK_STRATEGY": "pool"})
    assert str(raised.value) == (
        "invalid setting PGLOCK_STRATEGY='pool': must be 'connect', 'reuse' or 'shared'"
    )


def test_an_empty_environment_variable_counts_as_unset() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load_config({}, environ={"PGLOCK_STRATEGY": ""}).strategy == "reuse"


@pytest.mark.parametrize("flags", [0, re.IGNORECASE])
def test_celerys_secret_pattern_is_extended_once_to_pglock_dsn(
    monkeypatch: pytest.MonkeyPatch, flags: int
) -> None:
    original = re.compile("API|TOKEN|SECRET|PASS", flags)
    monkeypatch.setattr(celery.app.utils, "HIDDEN_SETTINGS", original)
    config_module._mask_in_celery_reports()
    extended = celery.app.utils.HIDDEN_SETTINGS
    assert extended.flags == original.flags
    for name in ("pglock_dsn", "PGLOCK_DSN", "CELERY_PGLOCK_DSN", "celery_pglock_dsn", "PASS"):
        assert extended.search(name), name
    assert not extended.search("pglock_strategy")
    assert bool(extended.search("token")) is bool(flags)  # Celery's own part unchanged
    config_module._mask_in_celery_reports()
    assert celery.app.utils.HIDDEN_SETTINGS is extended  # already masked: left as it is


@pytest.mark.parametrize("hidden", [None, "SECRET"])
def test_a_celery_without_a_secret_pattern_is_left_alone(
    monkeypatch: pytest.MonkeyPatch, hidden: Any
) -> None:
    monkeypatch.setattr(celery.app.utils, "HIDDEN_SETTINGS", hidden)
    config_module._mask_in_celery_reports()
    assert celery.app.utils.HIDDEN_SETTINGS == hidden


def test_a_bad_setting_fails_every_read_until_it_is_fixed() -> None:
    app = Celery("fixed-later", set_as_current=False)
    app.conf.update(pglock_dsn="dbname=x", pglock_on_lost="kill")
    for _ in range(2):  # never cached as if it were the default
        with pytest.raises(ConfigurationError, match="pglock_on_lost='kill'"):
            get_config(app)
    app.conf.pglock_on_lost = "terminate"
    assert get_config(app).on_lost == "terminate"


def test_without_a_conf_only_the_environment_counts() -> None:
    assert load_config(None, environ={"PGLOCK_STRATEGY": "connect"}).strategy == "connect"


def test_with_dsn_none_keeps_the_very_config() -> None:
    config = PglockConfig(dsn="dbname=a")
    assert config.with_dsn(None) is config
    assert config.with_dsn("dbname=b") == PglockConfig(dsn="dbname=b")


def test_a_namespaced_setting_changed_after_first_use_counts_at_the_next_call() -> None:
    class Settings:
        CELERY_BROKER_URL = "memory://"
        CELERY_PGLOCK_DSN = "dbname=first"

    app = Celery("ns-change", set_as_current=False)
    app.config_from_object(Settings, namespace="CELERY")
    assert get_config(app).dsn == "dbname=first"
    app.conf["CELERY_PGLOCK_DSN"] = "dbname=second"
    assert get_config(app).dsn == "dbname=second"
    Settings.CELERY_PGLOCK_DSN = "dbname=third"  # the object itself, behind the conf
    app.conf.pop("CELERY_PGLOCK_DSN")
    assert get_config(app).dsn == "dbname=third"


def test_a_missing_dsn_says_where_to_set_it() -> None:
    with pytest.raises(ConfigurationError) as raised:
        PglockConfig().require_dsn()
    assert str(raised.value) == (
        "no lock database configured: set the Celery setting pglock_dsn "
        "or the environment variable PGLOCK_DSN (under Django, pglock_database "
        "may name a DATABASES alias instead)"
    )


def test_a_malformed_dsn_says_how_to_keep_the_password_out() -> None:
    with pytest.raises(ConfigurationError) as raised:
        PglockConfig(dsn="host=h password=x oops").require_dsn()
    assert str(raised.value).endswith(
        "its text is not shown. Keep the password out of the DSN: PGPASSWORD or a passfile"
        " (PGPASSFILE)"
    )


def test_a_bad_value_under_a_lowercase_namespace_is_named_as_written() -> None:
    app = Celery("lower-ns", set_as_current=False)
    app.config_from_object(
        {"celery_broker_url": "memory://", "celery_pglock_check_interval": "soon"},
        namespace="celery",
    )
    with pytest.raises(
        ConfigurationError, match=r"^invalid setting celery_pglock_check_interval='soon': "
    ):
        get_config(app)


def test_a_celery_without_the_secret_pattern_attribute_is_left_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delattr(celery.app.utils, "HIDDEN_SETTINGS")
    config_module._mask_in_celery_reports()
    assert not hasattr(celery.app.utils, "HIDDEN_SETTINGS")
