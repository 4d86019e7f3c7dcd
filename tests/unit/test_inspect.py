"""Reading a holder back from its application_name."""

from __future__ import annotations

import os
import uuid

import pytest

from pglock_celery import lock_key
from pglock_celery.inspect import holder_from_row, parse_application_name
from pglock_celery.keys import key_to_lock_fields
from pglock_celery.session import application_name

#: The row's client address, start, state change and state, unknown.
NONE = (None, None, None, None)


def test_full_application_name_gives_every_field() -> None:
    task = str(uuid.uuid4())
    app_name = application_name("pglock", "tenant:42", task, host="w1")
    parsed = parse_application_name(app_name, lock_key("tenant:42"))
    assert parsed == ("tenant:42", False, task, os.getpid(), "w1")


def test_a_uuid_sized_name_still_gives_task_pid_and_host() -> None:
    task, name = str(uuid.uuid4()), f"tenant:{uuid.uuid4()}"
    app_name = application_name("pglock", name, task, host="worker-7")
    parsed = parse_application_name(app_name, lock_key(name))
    assert parsed[1:] == (True, task, os.getpid(), "worker-7")
    assert name.startswith(str(parsed[0]))


def test_a_name_holding_the_separator_is_recovered_whole() -> None:
    app_name = application_name("pglock", "a|b", "t", host="h")
    assert parse_application_name(app_name, lock_key("a|b"))[:3] == ("a|b", False, "t")


@pytest.mark.parametrize("name", ["tenant:é", "租户:42", "line\nbreak"])
def test_a_name_of_any_script_round_trips(name: str) -> None:
    app_name = application_name("pglock", name, "t", host="h")
    assert parse_application_name(app_name, lock_key(name)) == (name, False, "t", os.getpid(), "h")


def test_a_cut_encoded_name_comes_back_as_a_marked_prefix() -> None:
    name = "租户:" + "é" * 40
    app_name = application_name("pglock", name, "t", host="h")
    parsed, truncated, task_id, _, host = parse_application_name(app_name, lock_key(name))
    assert truncated and name.startswith(str(parsed)) and len(str(parsed)) > 3
    assert (task_id, host) == ("t", "h")


def test_foreign_sessions_are_not_misread() -> None:
    assert parse_application_name("psql", 1) == (None, False, None, None, None)
    assert parse_application_name("a|b|c|d|e", 1) == (None, False, None, None, None)
    other = application_name("pglock", "tenant:1", "t", host="h")
    assert parse_application_name(other, lock_key("tenant:2"))[0] is None
    assert parse_application_name(other, lock_key("tenant:1"), prefix="other")[0] is None


def test_a_lock_taken_by_bare_key_still_gives_its_holder() -> None:
    app_name = application_name("pglock", "#-12345", "t", host="h")
    assert parse_application_name(app_name, -12345) == (None, False, "t", os.getpid(), "h")


def test_a_holder_is_described_with_its_task_id_whole() -> None:
    task = str(uuid.uuid4())
    app_name = application_name("pglock", "tenant:42", task, host="w1")
    [holder] = [holder_from_row((*key_to_lock_fields(lock_key("tenant:42")), 7, app_name, *NONE))]
    assert holder.describe() == f"task {task} (process {os.getpid()} on w1, backend 7)"
    assert holder.describe().count(task) == 1 and task == holder.as_dict()["task_id"]


def test_a_holder_without_a_task_or_from_elsewhere_is_described_by_what_is_known() -> None:
    fields = key_to_lock_fields(lock_key("tenant:42"))
    untasked = application_name("pglock", "tenant:42", None, host="w1")
    assert holder_from_row((*fields, 7, untasked, *NONE)).describe() == (
        f"process {os.getpid()} on w1 (backend 7)"
    )
    assert holder_from_row((*fields, 8, "psql", *NONE)).describe() == (
        "backend 8 (application_name 'psql')"
    )


def test_a_stamped_application_name_gives_the_grant_time_and_its_pid() -> None:
    import datetime as dt

    from pglock_celery.inspect import locked_at

    started = dt.datetime(2026, 12, 1, 10, 0, tzinfo=dt.timezone.utc)
    app_name = f"pglock|{os.getpid()}.3c|~AAAAAAAAAAAAAAAAAAAAAA|h|tenant:1"
    assert locked_at(app_name, started) == started + dt.timedelta(seconds=60)
    assert parse_application_name(app_name, lock_key("tenant:1"))[3] == os.getpid()
    assert locked_at("pglock|123|-|h|tenant:1", started) is None  # not stamped
    assert locked_at("pglock|123.zz|-|h|tenant:1", started) is None  # not hex
    assert locked_at("psql", started) is None
