"""Every number a setting takes is finite and means what it says: an infinity, a NaN, a
value that libpq, Postgres, the kernel or Celery would not take is refused at load (so at
worker start), naming the setting, instead of failing every lock with a bare error."""

from __future__ import annotations

import itertools
import math
import re
import shlex
from datetime import datetime, timedelta, timezone
from types import SimpleNamespace
from typing import Any

import pytest
from celery import Celery
from hypothesis import given, settings
from hypothesis import strategies as st

from pglock_celery import ConfigurationError, PglockError
from pglock_celery.config import PglockConfig, load_config
from pglock_celery.session import connect_kwargs
from pglock_celery.task import _refuse_to_start

#: libpq and Postgres read these parameters as a C int.
INT_MAX = 2**31 - 1

SECONDS = (
    "connect_timeout",
    "tcp_user_timeout",
    "server_tcp_user_timeout",
    "server_connection_check_interval",
    "check_interval",
    "retry_countdown",
)
#: Sent to libpq or Postgres in whole milliseconds.
MILLISECONDS = ("tcp_user_timeout", "server_tcp_user_timeout", "server_connection_check_interval")
#: Linux's limits: TCP_KEEPIDLE and TCP_KEEPINTVL 32767 s, TCP_KEEPCNT 127 probes.
KEEPALIVES = {
    "keepalives_idle": 32767,
    "keepalives_interval": 32767,
    "keepalives_count": 127,
    "server_keepalives_idle": 32767,
    "server_keepalives_interval": 32767,
    "server_keepalives_count": 127,
}
COUNTS = (*KEEPALIVES, "idle_sessions", "shared_sessions")

NOT_FINITE = (math.inf, -math.inf, math.nan, 10**400, "inf", "-Infinity", "nan", "1e400")

numbers = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(min_value=-(10**400), max_value=10**400),
    st.sampled_from([0.0005, 0.001, 2147483.647, 2147483.648, 32767, 32768, 127, 128, 1.5e308]),
)
#: As app.conf holds them, or as an environment variable spells them.
raws = numbers | numbers.map(str)


def refused(name: str, raw: Any) -> str:
    """The message loading ``pglock_<name> = raw`` fails with (a ConfigurationError)."""
    with pytest.raises(ConfigurationError) as raised:
        load_config({f"pglock_{name}": raw}, environ={})
    message = str(raised.value)
    assert message.startswith(f"invalid setting pglock_{name}={raw!r}: "), message
    return message


def session_settings(kwargs: dict[str, object]) -> dict[str, int]:
    """The ``-c name=value`` server settings in a lock session's startup options."""
    words = shlex.split(str(kwargs["options"]))
    pairs = (word.split("=", 1) for flag, word in itertools.pairwise(words) if flag == "-c")
    return {name: int(value) for name, value in pairs if re.fullmatch(r"-?\d+", value)}


def assert_libpq_and_postgres_take(config: PglockConfig) -> None:
    """The lock session's parameters are whole numbers libpq and Postgres accept, none 0."""
    kwargs = connect_kwargs(config, "x")
    ours = {
        name: kwargs[name]
        for name in (
            "connect_timeout",
            "keepalives_idle",
            "keepalives_interval",
            "keepalives_count",
            "tcp_user_timeout",
        )
    }
    server = session_settings(kwargs)
    for name in (
        "tcp_keepalives_idle",
        "tcp_keepalives_interval",
        "tcp_keepalives_count",
        "tcp_user_timeout",
        "client_connection_check_interval",
    ):
        ours[f"server {name}"] = server[name]
    for name, value in ours.items():
        assert isinstance(value, int) and not isinstance(value, bool), (name, value)
        assert 1 <= value <= INT_MAX, (name, value)  # 0 would mean "off" or "system default"


@pytest.mark.parametrize("raw", NOT_FINITE, ids=repr)
@pytest.mark.parametrize("name", SECONDS)
def test_an_infinite_or_nan_number_of_seconds_is_refused_naming_the_setting(
    name: str, raw: Any
) -> None:
    assert refused(name, raw).endswith(": must be a finite number of seconds")


@pytest.mark.parametrize("name", SECONDS)
def test_an_infinite_environment_variable_is_refused_naming_the_variable(name: str) -> None:
    variable = f"PGLOCK_{name.upper()}"
    with pytest.raises(ConfigurationError) as raised:
        load_config({}, environ={variable: "inf"})
    assert str(raised.value) == (
        f"invalid setting {variable}='inf': must be a finite number of seconds"
    )


def test_the_refusal_is_a_pglock_error() -> None:
    with pytest.raises(PglockError):
        load_config({}, environ={"PGLOCK_TCP_USER_TIMEOUT": "inf"})


@pytest.mark.parametrize("name", MILLISECONDS)
def test_a_millisecond_setting_beyond_a_c_int_of_milliseconds_is_refused(name: str) -> None:
    assert refused(name, 2147483.648).endswith(
        ": must be at most 2147483.647 (2**31 - 1 ms): libpq and Postgres take it as a C int"
        " of milliseconds"
    )
    assert getattr(load_config({f"pglock_{name}": 2147483.647}, environ={}), name) == 2147483.647


@pytest.mark.parametrize("name", MILLISECONDS)
def test_a_millisecond_setting_below_one_millisecond_is_refused(name: str) -> None:
    message = refused(name, "0.0009")
    assert ": must be at least 0.001 (1 ms): it is sent in whole milliseconds, and 0 " in message
    assert getattr(load_config({f"pglock_{name}": "0.001"}, environ={}), name) == 0.001


def test_a_connect_timeout_beyond_a_c_int_of_seconds_is_refused() -> None:
    assert refused("connect_timeout", float(INT_MAX) + 1).endswith(
        f": must be at most {INT_MAX}: libpq takes it as a C int of seconds"
    )
    assert load_config({"pglock_connect_timeout": INT_MAX}, environ={}).connect_timeout == INT_MAX


def test_an_infinite_check_interval_no_longer_turns_loss_detection_off() -> None:
    assert refused("check_interval", "inf").endswith(": must be a finite number of seconds")
    assert refused("check_interval", 1.5e308).endswith(
        ": must be small enough that 1.25 times it (the bound within which a loss is"
        " noticed) is finite"
    )


def test_a_retry_countdown_that_celery_cannot_turn_into_an_eta_is_refused() -> None:
    assert refused("retry_countdown", 1e12).endswith(
        ": must be short enough that Celery's eta (now plus it) falls before the year 10000"
    )
    day = load_config({"pglock_retry_countdown": 86400}, environ={}).retry_countdown
    assert day == 86400.0


@pytest.mark.parametrize(("name", "most"), KEEPALIVES.items())
def test_a_keepalive_beyond_linuxs_limit_is_refused_saying_so(name: str, most: int) -> None:
    option = {"idle": "TCP_KEEPIDLE", "interval": "TCP_KEEPINTVL", "count": "TCP_KEEPCNT"}
    assert refused(name, most + 1).endswith(
        f": must be at most {most}, Linux's limit for {option[name.rsplit('_', 1)[1]]}"
    )
    assert getattr(load_config({f"pglock_{name}": str(most)}, environ={}), name) == most


@pytest.mark.parametrize("raw", ["inf", "1e400", "nan", math.inf, math.nan, 2.5, "2.5", True])
@pytest.mark.parametrize("name", COUNTS)
def test_a_count_that_is_not_a_whole_number_is_refused_not_truncated(name: str, raw: Any) -> None:
    least = ", 0 or more" if name == "idle_sessions" else " greater than 0"
    assert refused(name, raw).endswith(f": must be a whole number{least}")


@pytest.mark.parametrize("name", COUNTS)
def test_a_whole_float_is_taken_as_its_count(name: str) -> None:
    value = getattr(load_config({f"pglock_{name}": 3.0}, environ={}), name)
    assert value == 3 and type(value) is int


@pytest.mark.parametrize("name", SECONDS)
def test_a_bool_is_not_a_number_of_seconds(name: str) -> None:
    assert refused(name, True).endswith(": must be a number of seconds, not True")


@settings(max_examples=600, deadline=None)
@given(name=st.sampled_from(SECONDS), raw=raws)
def test_a_number_of_seconds_is_refused_naming_it_or_gives_a_session_libpq_takes(
    name: str, raw: Any
) -> None:
    try:
        config = load_config({"pglock_dsn": "dbname=test", f"pglock_{name}": raw}, environ={})
    except ConfigurationError as exc:
        assert str(exc).startswith(f"invalid setting pglock_{name}={raw!r}: ")
        return
    value = getattr(config, name)
    assert type(value) is float and math.isfinite(value) and value > 0
    assert_libpq_and_postgres_take(config)
    assert math.isfinite(config.client_bound) and math.isfinite(config.server_bound)
    # Celery's eta for a retry: now plus the countdown, as a datetime.
    eta = datetime.now(timezone.utc) + timedelta(seconds=config.retry_countdown)
    assert eta.year <= 9999


@settings(max_examples=300, deadline=None)
@given(
    name=st.sampled_from(SECONDS),
    value=st.floats().filter(lambda v: not v > 0)
    | st.sampled_from([math.inf, -math.inf, math.nan])
    | st.integers(min_value=2**1024, max_value=10**400),
)
def test_every_infinite_nan_huge_or_not_positive_number_of_seconds_is_refused(
    name: str, value: Any
) -> None:
    for raw in (value, str(value)):
        refused(name, raw)


@settings(max_examples=600, deadline=None)
@given(name=st.sampled_from(COUNTS), raw=raws)
def test_a_count_is_refused_naming_it_or_is_exactly_the_whole_number_given(
    name: str, raw: Any
) -> None:
    try:
        config = load_config({"pglock_dsn": "dbname=test", f"pglock_{name}": raw}, environ={})
    except ConfigurationError as exc:
        assert str(exc).startswith(f"invalid setting pglock_{name}={raw!r}: ")
        return
    value = getattr(config, name)
    assert type(value) is int
    assert value == (int(raw) if isinstance(raw, str) else raw)  # never truncated
    assert_libpq_and_postgres_take(config)


def test_a_worker_with_an_infinite_setting_refuses_to_start_naming_it() -> None:
    app = Celery("finite", set_as_current=False, broker="memory://")
    app.conf.update(pglock_tcp_user_timeout="inf", pglock_check_interval="inf")
    with pytest.raises(SystemExit) as exited:
        _refuse_to_start(sender=SimpleNamespace(app=app, hostname="w@h"))
    assert str(exited.value) == (
        "pglock-celery: worker w@h refuses to start:\n"
        "  - invalid settings: pglock_tcp_user_timeout='inf': must be a finite number of"
        " seconds; pglock_check_interval='inf': must be a finite number of seconds"
    )


def test_a_config_built_directly_with_an_infinite_setting_is_refused() -> None:
    with pytest.raises(ConfigurationError) as raised:
        PglockConfig(dsn="dbname=test", tcp_user_timeout=math.inf)
    assert str(raised.value) == (
        "invalid PglockConfig: tcp_user_timeout=inf: must be a finite number of seconds"
    )


def test_the_defaults_are_accepted_and_give_a_session_libpq_takes() -> None:
    assert_libpq_and_postgres_take(PglockConfig(dsn="dbname=test"))


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("strategy", "bogus"),
        ("on_lost", "kill"),
        ("pooler", "transaction"),
        ("report_holder", "maybe"),
        ("application_name", "has|bar"),
    ],
)
def test_a_config_built_directly_refuses_what_no_setting_may_be(field: str, value: object) -> None:
    with pytest.raises(ConfigurationError, match=f"{field}="):
        PglockConfig(**{field: value})  # type: ignore[arg-type]


def test_a_config_built_directly_keeps_its_values_as_parsed() -> None:
    """A whole float where libpq wants an int, a number given as text: kept as parsed."""
    config = PglockConfig(keepalives_idle=1.0, check_interval="2")  # type: ignore[arg-type]
    assert config.keepalives_idle == 1 and type(config.keepalives_idle) is int
    assert config.check_interval == 2.0 and type(config.check_interval) is float
