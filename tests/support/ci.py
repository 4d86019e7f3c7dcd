"""Whether this is a CI run: there a capability the machine lacks fails the test, never skips."""

from __future__ import annotations

import os
from collections.abc import Mapping

import pytest


def in_ci(environ: Mapping[str, str]) -> bool:
    """Whether ``environ`` says this is a CI run: CI=true, 1 or yes (any case)."""
    return environ.get("CI", "").strip().lower() in {"1", "true", "yes"}


#: In CI a capability the machine lacks must fail the run, never skip.
IN_CI = in_ci(os.environ)


def missing(why: str) -> None:
    """A capability the test needs is missing: fail in CI, skip elsewhere."""
    if IN_CI:
        pytest.fail(f"{why} (CI: a capability the tests must cover cannot be missing)")
    pytest.skip(why)
