"""How a lock session identifies itself and what it asks of the server."""

from __future__ import annotations

import os
import uuid

import pytest

from pglock_celery import ConfigurationError
from pglock_celery.config import PglockConfig
from pglock_celery.session import (
    APPLICATION_NAME_MAX_BYTES,
    application_name,
    compact_task_id,
    connect_kwargs,
    decode_name,
    encode_name,
    expand_task_id,
)


def test_application_name_carries_pid_task_host_and_lock() -> None:
    name = application_name("pglock", "tenant:42", "abc", host="w1")
    assert name == f"pglock|{os.getpid()}|abc|w1|tenant:42"


def test_application_name_marks_a_missing_task_id() -> None:
    assert application_name("pglock", "n", None, host="h").split("|")[2] == "-"


def test_uuid_task_ids_are_compacted_and_restored() -> None:
    task_id = str(uuid.uuid4())
    compact = compact_task_id(task_id)
    assert len(compact) == 23 and compact.startswith("~")
    assert expand_task_id(compact) == task_id
    assert expand_task_id(compact_task_id("custom-id")) == "custom-id"


def test_a_long_name_is_what_the_63_byte_cut_shortens_never_the_holder() -> None:
    task_id = str(uuid.uuid4())
    name = application_name("pglock", f"tenant:{uuid.uuid4()}", task_id, host="worker-7")
    assert len(name.encode()) == APPLICATION_NAME_MAX_BYTES
    assert name.split("|")[1:4] == [str(os.getpid()), compact_task_id(task_id), "worker-7"]


def test_a_host_too_long_for_the_rest_is_cut_and_marked() -> None:
    name = application_name("pglock", "t:1", str(uuid.uuid4()), host="h" * 80)
    assert len(name.encode()) <= APPLICATION_NAME_MAX_BYTES
    host = name.split("|")[3]
    assert host.endswith("~") and set(host[:-1]) == {"h"}


@pytest.mark.parametrize("lock", ["tenant:é", "line\nbreak", "=looks-encoded", "租户:42", "tab\t"])
def test_names_postgres_would_mangle_are_written_in_printable_ascii(lock: str) -> None:
    field = encode_name(lock)
    assert field.isascii() and field.isprintable() and "|" not in field
    assert decode_name(field) == (lock, True)


def test_plain_names_are_written_as_they_are() -> None:
    assert encode_name("training:tenant-042|x") == "training:tenant-042|x"


def test_connect_kwargs_keep_the_dsns_own_options() -> None:
    config = PglockConfig(dsn="host=h options='-c search_path=app'")
    kwargs = connect_kwargs(config, "pglock|n|-|1@h")
    options = str(kwargs["options"])
    assert options.startswith("-c search_path=app ")
    assert "-c idle_session_timeout=0" in options
    assert "-c tcp_keepalives_idle=4" in options
    assert kwargs["target_session_attrs"] == "read-write"
    assert kwargs["autocommit"] is True
    assert kwargs["application_name"] == "pglock|n|-|1@h"


def test_client_detects_a_dead_peer_before_the_server_frees_the_lock() -> None:
    config = PglockConfig()
    assert config.client_bound == 7.5
    assert config.server_bound == 15.0
    # The server's fastest way to free the lock must still come after the client knew.
    fastest_server = min(
        config.server_tcp_user_timeout,
        config.server_keepalives_idle
        + config.server_keepalives_interval * config.server_keepalives_count,
    )
    assert config.client_bound < fastest_server


@pytest.mark.parametrize(
    "dsn", ["host=h password=hunter2 oops", "postgresql://u:hunter2/oops@h/db"]
)
def test_malformed_dsn_is_a_configuration_error_without_the_password(dsn: str) -> None:
    config = PglockConfig(dsn=dsn)
    with pytest.raises(ConfigurationError, match="not a valid connection string") as raised:
        connect_kwargs(config, "x")
    assert "hunter2" not in str(raised.value)
    assert "oops" not in str(raised.value)
    assert raised.value.__cause__ is None and raised.value.__context__ is None
