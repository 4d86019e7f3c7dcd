"""tests/README.md names every test file: the map of what proves what is whole."""

from __future__ import annotations

from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_every_test_file_has_a_row_in_the_tests_map() -> None:
    rows = (TESTS / "README.md").read_text()
    unnamed = sorted(
        str(path.relative_to(TESTS))
        for path in TESTS.glob("*/test_*.py")
        if f"`{path.name}`" not in rows
    )
    assert unnamed == [], f"tests/README.md has no row for {', '.join(unnamed)}"
