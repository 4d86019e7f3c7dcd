"""The README documents every setting with its default."""

from __future__ import annotations

from pathlib import Path

from pglock_celery.config import SETTINGS

README = Path(__file__).resolve().parents[2] / "README.md"


def test_every_setting_is_documented_with_its_default() -> None:
    rows = {
        line.split("|")[1].strip(" `"): line
        for line in README.read_text().splitlines()
        if line.startswith("| `pglock_")
    }
    for key, env, default in SETTINGS:
        assert key in rows, f"{key} is not in the README's settings table"
        assert f"`{env}`" in rows[key]
        shown = "none (required)" if default is None else f"`{default}`"
        assert shown in rows[key], f"{key}: README does not show the default {shown}"
