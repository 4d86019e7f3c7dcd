"""A warm call crosses few library modules and functions (the core stays one a person can hold).

Counted with a sys.setprofile trace of library frames only (bench/trace.py).
"""

from __future__ import annotations

import pytest

from bench.trace import warm_paths

#: The bounds of issue 17: library modules and distinct functions on one warm call.
MAX_MODULES = 7
MAX_FUNCTIONS = 30


@pytest.mark.parametrize("path", ["lock cycle", "task call"])
def test_a_warm_call_crosses_at_most_seven_modules_and_thirty_functions(
    pg_dsn: str, path: str
) -> None:
    calls = warm_paths(pg_dsn)[path]
    modules = {module for module, _ in calls}
    functions = set(calls)
    assert len(modules) <= MAX_MODULES, sorted(modules)
    assert len(functions) <= MAX_FUNCTIONS, sorted(functions)
