"""How a lock session identifies itself and what it asks of the server."""

from __future__ import annotations

import os
import uuid

import pytest

from pglock_celery import ConfigurationError
from pglock_celery.config import PglockConfig
from pglock_celery.connection import (
    APPLICATION_NAME_MAX_BYTES,
    application_name,
    compact_task_id,
    connect_kwargs,
    expand_task_id,
)


def test_application_name_carries_lock_pid_task_and_host() -> None:
    name = application_name("pglock", "tenant:42", "abc", host="w1")
    assert name == f"pglock|tenant:42|{os.getpid()}|abc|w1"


def test_application_name_marks_a_missing_task_id() -> None:
    assert application_name("pglock", "n", None, host="h").split("|")[3] == "-"


def test_uuid_task_ids_are_compacted_and_restored() -> None:
    task_id = str(uuid.uuid4())
    compact = compact_task_id(task_id)
    assert len(compact) == 23 and compact.startswith("~")
    assert expand_task_id(compact) == task_id
    assert expand_task_id(compact_task_id("custom-id")) == "custom-id"


def test_a_typical_tenant_lock_keeps_name_pid_and_task_id_within_63_bytes() -> None:
    name = application_name("pglock", "training:tenant-001", str(uuid.uuid4()), host="h")
    assert len(name.encode()) <= APPLICATION_NAME_MAX_BYTES
    assert name.split("|")[4] == "h"


def test_long_application_name_is_cut_to_63_bytes_on_a_character_boundary() -> None:
    name = application_name("pglock", "tenant:" + "é" * 60, "task", host="h")
    assert len(name.encode()) <= APPLICATION_NAME_MAX_BYTES
    assert name.startswith("pglock|tenant:é")
    name.encode().decode()  # still valid UTF-8


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
