"""The migration page's recipes (docs/migrating.md), run as written."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

from pglock_celery import TenantLockedTask, lock_key

README = Path(__file__).resolve().parents[2] / "docs" / "migrating.md"


def recipe(name: str) -> dict[str, Any]:
    """Run the code block of docs/migrating.md that starts with `# recipe: <name>`."""
    blocks = re.findall(r"```python\n# recipe: (\w+)\n(.*?)```", README.read_text(), re.S)
    code = dict(blocks)[name]
    namespace: dict[str, Any] = {}
    exec(compile(code, f"README recipe {name}", "exec"), namespace)
    return namespace


def test_pals_and_django_pglock_keys_are_theirs() -> None:
    """Keys computed by pals 0.4.0 and django-pglock 1.8.0 themselves, for the same names."""
    keys = recipe("keys")
    assert keys["pals_key"]("billing", "tenant:42") == -2158430120636789129
    assert keys["django_pglock_key"]("tenant:42") == 9221150847898377547
    for key in (keys["pals_key"]("billing", "tenant:42"), keys["django_pglock_key"]("x")):
        assert -(2**63) <= key < 2**63
    assert keys["django_pglock_key"]("tenant:42") != lock_key("tenant:42")


def test_a_skip_result_is_not_a_run() -> None:
    ran = recipe("skipped")["ran"]
    assert not ran({"skipped": True, "lock": "tenant:1", "holder": None})
    assert ran({"tenant": "1", "outcome": "submitted"})
    assert ran(None) and ran("done") and ran({"skipped": False})


@pytest.fixture
def app() -> Celery:
    return Celery("recipes", set_as_current=False)


def test_a_dict_in_a_template_makes_one_name_per_key_order(app: Celery) -> None:
    """The pitfall the recipe exists for: str() of a dict follows insertion order."""

    @app.task(base=TenantLockedTask, lock_name="report:{filters}", shared=False)
    def by_template(filters: dict[str, int]) -> None: ...

    one = by_template.resolve_lock_name(({"a": 1, "b": 2},), {})
    other = by_template.resolve_lock_name(({"b": 2, "a": 1},), {})
    assert one != other


def test_the_canonical_lock_name_ignores_key_order(app: Celery) -> None:
    report_lock = recipe("canonical")["report_lock"]

    @app.task(base=TenantLockedTask, lock_name=report_lock, shared=False)
    def build_report(filters: dict[str, int]) -> None: ...

    one = build_report.resolve_lock_name(({"a": 1, "b": [2, 3]},), {})
    other = build_report.resolve_lock_name((), {"filters": {"b": [2, 3], "a": 1}})
    assert one == other == 'report:{"a":1,"b":[2,3]}'
    assert build_report.resolve_lock_name(({"a": 2},), {}) != one
