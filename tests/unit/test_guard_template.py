"""Guard templates: the task lock_name syntax, parsed in Python, turned into quoted SQL."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pglock_celery import ConfigurationError
from pglock_celery.guard import (
    layout,
    name_changed,
    name_expression,
    parse_template,
    shared_functions,
    template_columns,
    trigger_function_body,
    trigger_function_name,
)


@pytest.mark.parametrize(
    ("template", "parts"),
    [
        ("training:{tenant_id}", [("training:", "tenant_id")]),
        ("{region}/{tenant_id}", [("", "region"), ("/", "tenant_id")]),
        ("onboarding", [("onboarding", None)]),
        ("{{literal}}:{x}", [("{", None), ("literal}", None), (":", "x")]),
        ("{Tenant}", [("", "Tenant")]),
    ],
)
def test_plain_field_names_parse_into_literals_and_columns(
    template: str, parts: list[tuple[str, str | None]]
) -> None:
    assert parse_template(template) == parts


@pytest.mark.parametrize(
    ("template", "says"),
    [
        ("", "non-empty"),
        ("t:{}", "plain column name"),
        ("t:{0}", "plain column name"),
        ("t:{a.b}", "plain column name"),
        ("t:{a[0]}", "plain column name"),
        ("t:{a!r}", "conversion or format spec"),
        ("t:{a:>5}", "conversion or format spec"),
        ("t:{a", "t:{a"),
        ("t:}", "t:}"),
    ],
)
def test_anything_but_plain_field_names_is_a_configuration_error(template: str, says: str) -> None:
    with pytest.raises(ConfigurationError, match=says.replace("{", r"\{").replace("[", r"\[")):
        parse_template(template)


def test_a_template_that_is_not_a_str_is_refused() -> None:
    with pytest.raises(ConfigurationError, match="non-empty str"):
        parse_template(42)  # type: ignore[arg-type]


def test_columns_are_listed_once_in_order() -> None:
    assert template_columns("{b}:{a}:{b}") == ["b", "a"]


def test_name_expression_quotes_identifiers_and_literals() -> None:
    expression = name_expression(parse_template("it's:{Tenant}"), "NEW").as_string(None)
    assert expression == """'it''s:' || coalesce(NEW."Tenant"::text, 'None')"""


@pytest.mark.parametrize("by_statement", [False, True])
def test_the_trigger_checks_old_and_new_names_and_reads_no_pg_locks_itself(
    by_statement: bool,
) -> None:
    body = trigger_function_body(parse_template("t:{tenant_id}"), by_statement=by_statement)
    text = body.as_string(None)
    assert "lock_name := 't:' || coalesce(OLD.\"tenant_id\"::text, 'None')" in text
    assert "lock_name := 't:' || coalesce(NEW.\"tenant_id\"::text, 'None')" in text
    assert "pg_try_advisory_xact_lock(key)" in text
    assert "pg_locks" not in text  # only the slow path, pglock_guard_check, reads it
    assert ("pglock_old_rows" in text) == ("pglock_new_rows" in text) == by_statement


def test_by_statement_each_distinct_name_is_told_apart_byte_for_byte() -> None:
    body = trigger_function_body(parse_template("t:{tenant_id}"), by_statement=True)
    text = body.as_string(None)
    for rows in ("pglock_old_rows", "pglock_new_rows"):
        assert (
            f"SELECT DISTINCT ('t:' || coalesce({rows}.\"tenant_id\"::text, 'None'))"
            ' COLLATE pg_catalog."C"'
        ) in text


@pytest.mark.parametrize("table", ["pipelines", "x" * 50, "é" * 40])
def test_trigger_function_names_fit_63_bytes(table: str) -> None:
    name = trigger_function_name(table)
    assert name.startswith("pglock_guard_")
    assert len(name.encode()) <= 63


def test_short_names_are_readable_and_long_ones_stay_apart() -> None:
    assert trigger_function_name("pipelines") == "pglock_guard_pipelines"
    assert trigger_function_name("x" * 60 + "a") != trigger_function_name("x" * 60 + "b")


@settings(database=None)
@given(st.text(alphabet=st.characters(blacklist_characters="{}"), max_size=30))
def test_a_template_without_fields_is_one_literal(text: str) -> None:
    assert parse_template(text or "x") == [(text or "x", None)]


#: Every built-in the guard's SQL calls: each call must name pg_catalog.
BUILTINS = (
    "current_setting",
    "strpos",
    "pg_try_advisory_xact_lock_shared",
    "pg_try_advisory_xact_lock",
    "lower",
    "md5",
    "left",
    "convert_to",
    "format",
    "pg_backend_pid",
    "current_database",
)


@pytest.mark.parametrize("encoding", ["UTF8", "LATIN1"])
def test_every_builtin_the_guard_calls_is_schema_qualified(encoding: str) -> None:
    texts = [
        trigger_function_body(parse_template("t:{a}/{b}"), by_statement=by).as_string(None)
        for by in (False, True)
    ]
    texts += [body for _, _, body in shared_functions(encoding)]
    for text in texts:
        for builtin in BUILTINS:
            bare = re.findall(rf"(?<![\w.]){builtin}\s*\(", text)
            assert not bare, f"{builtin}() called without pg_catalog. in:\n{text}"
    for _, create, _ in shared_functions(encoding):
        if "plpgsql" in create:
            assert "SET search_path = pg_catalog, pg_temp" in create


def test_the_stored_update_check_fires_only_when_the_text_of_a_name_column_changes() -> None:
    """Byte for byte: under a nondeterministic collation 'a' = 'A', yet two names."""
    assert name_changed(parse_template("t:{b}/{a}/{b}")).as_string(None) == (
        'NEW."b"::text COLLATE pg_catalog."C" IS DISTINCT FROM OLD."b"::text COLLATE'
        ' pg_catalog."C" OR NEW."a"::text COLLATE pg_catalog."C" IS DISTINCT FROM'
        ' OLD."a"::text COLLATE pg_catalog."C"'
    )
    assert name_changed(parse_template("global")).as_string(None) == "false"


def clauses(by_statement: bool) -> dict[str, str]:
    """Each trigger of a layout as CREATE TRIGGER says it (its name, then ON ... aside)."""
    return {
        t.name: f"{t.clause().as_string(None)} ON t{t.tail().as_string(None)}"
        for t in layout(parse_template("t:{a}"), by_statement=by_statement)
    }


def test_by_statement_the_old_and_new_rows_come_from_transition_tables() -> None:
    when = (
        'NEW."a"::text COLLATE pg_catalog."C" IS DISTINCT FROM OLD."a"::text COLLATE pg_catalog."C"'
    )
    assert clauses(by_statement=True) == {
        "zz_pglock_guard": 'AFTER UPDATE ON t REFERENCING OLD TABLE AS "pglock_old_rows"'
        " FOR EACH STATEMENT",
        "zz_pglock_guard_delete": 'AFTER DELETE ON t REFERENCING OLD TABLE AS "pglock_old_rows"'
        " FOR EACH STATEMENT",
        "zz_pglock_guard_stored_insert": "AFTER INSERT ON t REFERENCING NEW TABLE AS"
        ' "pglock_new_rows" FOR EACH STATEMENT',
        # A row trigger with a transition table: the table can never become a child.
        "zz_pglock_guard_stored_update": "AFTER UPDATE ON t REFERENCING OLD TABLE AS"
        f' "pglock_old_rows" FOR EACH ROW WHEN ({when})',
    }


def test_by_row_no_trigger_names_a_transition_table() -> None:
    """Postgres refuses row triggers with transition tables on partitions and children."""
    assert clauses(by_statement=False) == {
        "zz_pglock_guard": "BEFORE UPDATE OR DELETE ON t FOR EACH ROW",
        "zz_pglock_guard_stored_insert": "AFTER INSERT ON t FOR EACH ROW",
        "zz_pglock_guard_stored_update": "AFTER UPDATE ON t FOR EACH ROW WHEN"
        ' (NEW."a"::text COLLATE pg_catalog."C" IS DISTINCT FROM OLD."a"::text COLLATE'
        ' pg_catalog."C")',
    }
