"""The README is short, for users, and self-contained on the package index; it and the
settings page document every setting with its default; the docs' recipes run as written."""

from __future__ import annotations

import inspect
import re
from pathlib import Path
from typing import Any

import pytest
import tomllib
from celery import Celery

from pglock_celery import TenantLockedTask
from pglock_celery.config import SETTINGS

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PROJECT_URL = "https://github.com/pglock-celery/pglock-celery"
RAW_URL = "https://raw.githubusercontent.com/pglock-celery/pglock-celery/main/"


def settings_rows(text: str) -> dict[str, str]:
    return {
        line.split("|")[1].strip(" `"): line
        for line in text.splitlines()
        if line.startswith("| `pglock_")
    }


@pytest.mark.parametrize("where", [README, DOCS / "settings.md"], ids=["README", "settings"])
def test_every_setting_is_documented_with_its_default(where: Path) -> None:
    rows = settings_rows(where.read_text())
    for key, env, default in SETTINGS:
        assert key in rows, f"{key} is not in {where.name}'s settings table"
        assert f"`{env}`" in rows[key]
        shown = "none" if default is None else f"`{default}`"
        assert shown in rows[key], f"{key}: {where.name} does not show the default {shown}"
    assert "none (required)" in rows["pglock_dsn"]


def test_the_readme_is_short_and_starts_with_the_pitch_install_and_example() -> None:
    text = README.read_text()
    assert len(text.splitlines()) <= 300
    headings = [line for line in text.splitlines() if line.startswith("## ")]
    assert headings[:3] == ["## Install", "## Example", "## From a checkout"], headings
    assert "pip install 'pglock-celery[redis,binary]'" in text
    assert "make run " in text and "make test " in text


def test_the_readmes_example_is_a_runnable_ten_line_task() -> None:
    """The first Python block defines a locked task when run (no broker is contacted)."""
    code = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)[0]
    lines = [line for line in code.splitlines() if line.strip()]
    assert len(lines) <= 12, lines
    namespace: dict[str, Any] = {}
    exec(compile(code, "README example", "exec"), namespace)
    task = namespace["advance_pipeline"]
    assert isinstance(task, TenantLockedTask)
    assert task.resolve_lock_name((42,), {}) == "training:42"


def test_the_readme_speaks_to_users_without_internal_shorthand() -> None:
    text = README.read_text()
    for shorthand in (r"\bG\d+\b", r"\bissue \d+", r"write-up", r"adversary"):
        assert not re.search(shorthand, text, re.I), f"README uses {shorthand!r}"


@pytest.mark.parametrize("where", [README, *sorted(DOCS.glob("*.md"))], ids=lambda p: p.name)
def test_no_page_says_a_release_returns_before_its_unlock(where: Path) -> None:
    """A release waits for its unlock: no page may say otherwise."""
    text = " ".join(where.read_text().split()).lower()
    for claim in ("not wait for its unlock", "unwaited", "does not wait for the unlock"):
        assert claim not in text, f"{where.name} still says {claim!r}"


def test_every_link_and_image_of_the_readme_is_absolute_and_points_at_a_real_file() -> None:
    """The package index shows the README without the repository: relative links break."""
    targets = re.findall(r"\]\(([^)\s]+)\)", README.read_text())
    assert targets
    for target in targets:
        assert target.startswith("https://"), f"relative link in the README: {target}"
        for prefix in (f"{PROJECT_URL}/blob/main/", f"{PROJECT_URL}/tree/main/", RAW_URL):
            if target.startswith(prefix):
                path = target[len(prefix) :].split("#")[0]
                assert (ROOT / path).exists(), f"the README links to a missing {path}"


def test_the_project_urls_are_in_the_metadata() -> None:
    urls = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["urls"]
    assert urls["Homepage"] == PROJECT_URL
    assert all(url.startswith(PROJECT_URL) for url in urls.values())


def recipe(name: str) -> dict[str, Any]:
    """Run the migration page's code block that starts with `# recipe: <name>`."""
    blocks = re.findall(
        r"```python\n# recipe: (\w+)\n(.*?)```", (DOCS / "migrating.md").read_text(), re.S
    )
    namespace: dict[str, Any] = {}
    exec(compile(dict(blocks)[name], f"docs recipe {name}", "exec"), namespace)
    return namespace


def test_the_every_argument_lock_name_binds_arguments_by_name() -> None:
    """celery-once without `keys`: positional, keyword and default spellings of one call
    take one lock; another value takes another."""
    every_argument = recipe("every_argument")["every_argument"]
    app = Celery("recipes", set_as_current=False)

    def sync_account(account_id: int, full: bool = False) -> None: ...

    task = app.task(base=TenantLockedTask, lock_name=every_argument(sync_account), shared=False)(
        sync_account
    )
    names = {
        task.resolve_lock_name((7,), {}),
        task.resolve_lock_name((7, False), {}),
        task.resolve_lock_name((), {"account_id": 7}),
    }
    assert len(names) == 1
    (name,) = names
    assert name.startswith(f"{__name__}.") and "sync_account" in name
    assert task.resolve_lock_name((7, True), {}) != name
    assert inspect.signature(task.run) == inspect.signature(sync_account)
