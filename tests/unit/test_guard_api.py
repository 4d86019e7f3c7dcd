"""The guard's public names and signatures, as DESIGN.md states them."""

from __future__ import annotations

import inspect

import pglock_celery
from pglock_celery import install_guard, remove_guard


def test_install_and_remove_are_exported() -> None:
    assert {"install_guard", "remove_guard"} <= set(pglock_celery.__all__)
    assert pglock_celery.__all__ == sorted(
        pglock_celery.__all__, key=lambda name: (not name.isupper(), not name[0].isupper(), name)
    )


def test_signatures_match_the_contract() -> None:
    assert list(inspect.signature(install_guard).parameters) == [
        "conn_or_dsn",
        "table",
        "lock_name",
    ]
    assert list(inspect.signature(remove_guard).parameters) == ["conn_or_dsn", "table"]
    assert inspect.signature(install_guard).return_annotation in (None, "None")
    assert inspect.signature(remove_guard).return_annotation in (None, "None")
