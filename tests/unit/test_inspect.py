"""Reading a holder back from its application_name."""

from __future__ import annotations

import os
import uuid

from pglock_celery import lock_key
from pglock_celery.connection import application_name
from pglock_celery.inspect import parse_application_name


def test_full_application_name_gives_every_field() -> None:
    task = str(uuid.uuid4())
    app_name = application_name("pglock", "tenant:42", task, host="w1")
    parsed = parse_application_name(app_name, lock_key("tenant:42"))
    assert parsed == ("tenant:42", False, task, os.getpid(), "w1")


def test_a_field_the_cut_may_have_shortened_is_dropped() -> None:
    name = "training:" + "t" * 20
    app_name = application_name("pglock", name, str(uuid.uuid4()), host="a-long-host-name")
    parsed = parse_application_name(app_name, lock_key(name))
    assert parsed[0] == name and parsed[3] == os.getpid()
    assert parsed[4] is None  # the host was cut: better unknown than wrong


def test_a_name_holding_the_separator_is_recovered_by_its_key() -> None:
    app_name = application_name("pglock", "a|b", "t", host="h")
    assert parse_application_name(app_name, lock_key("a|b"))[:3] == ("a|b", False, "t")


def test_a_name_cut_at_63_bytes_comes_back_as_a_marked_prefix() -> None:
    long_name = "tenant:" + "x" * 80
    app_name = application_name("pglock", long_name, "t", host="h")
    name, truncated, task_id, _, _ = parse_application_name(app_name, lock_key(long_name))
    assert truncated and long_name.startswith(str(name)) and task_id is None


def test_foreign_sessions_are_not_misread() -> None:
    assert parse_application_name("psql", 1) == (None, False, None, None, None)
    other = application_name("pglock", "tenant:1", "t", host="h")
    assert parse_application_name(other, lock_key("tenant:2"))[0] is None
    assert parse_application_name(other, lock_key("tenant:1"), prefix="other")[0] is None


def test_a_lock_taken_by_bare_key_still_gives_its_holder() -> None:
    app_name = application_name("pglock", "#-12345", "t", host="h")
    assert parse_application_name(app_name, -12345) == (None, False, "t", os.getpid(), "h")
