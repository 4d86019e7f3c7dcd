"""Which library modules and functions one warm call crosses: a sys.setprofile trace.

python -m bench.trace [--json]  (PGLOCK_DSN, else a local Postgres on 127.0.0.1:5432, database
test; --json: each path's distinct (module, function) pairs, for tests)

Counts the Python frames of pglock_celery only (C functions, the standard library,
psycopg and Celery are not counted): a warm ``try_lock`` cycle, and a warm
``TenantLockedTask`` call run in-process (no broker), each after two warm-up calls.
"""

from __future__ import annotations

import json
import os
import sys
import uuid
from collections.abc import Callable
from types import FrameType
from typing import Any

from celery import Celery, current_app

from pglock_celery import TenantLockedTask, try_lock

DEFAULT_DSN = "host=127.0.0.1 port=5432 user=postgres dbname=test"


def library_calls(call: Callable[[], Any]) -> list[tuple[str, str]]:
    """The (module, function) of every library frame entered while ``call`` runs."""
    seen: list[tuple[str, str]] = []

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if event == "call":
            module = frame.f_globals.get("__name__", "")
            if module.startswith("pglock_celery"):
                seen.append((module, frame.f_code.co_qualname))

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    return seen


def warm_paths(dsn: str) -> dict[str, list[tuple[str, str]]]:
    """The library calls of a warm lock cycle and of a warm task call on ``dsn``.

    The trace's app is the current one meanwhile (try_lock reads its settings), and
    the one that was current is again afterwards.
    """
    previous = current_app._get_current_object()
    app = Celery("pglock-trace", set_as_current=True)
    app.conf.pglock_dsn = dsn
    # Settings of its own: the process's source for them is keyed by this very config
    # object, as an app's is in a worker (another equal config would be compared too).
    app.conf.pglock_application_name = f"trace{uuid.uuid4().hex[:8]}"

    @app.task(base=TenantLockedTask, lock_name="trace:{tenant_id}", shared=False)
    def step(tenant_id: int) -> int:
        return tenant_id

    def cycle() -> None:
        with try_lock("trace:cycle") as lock:
            assert lock.acquired

    def task_call() -> None:
        assert step(1) == 1

    paths = {}
    try:
        for name, call in (("lock cycle", cycle), ("task call", task_call)):
            call()
            call()
            paths[name] = library_calls(call)
    finally:
        previous.set_current()
    return paths


def main() -> None:
    dsn = os.environ.get("PGLOCK_DSN", DEFAULT_DSN)
    paths = warm_paths(dsn)
    if "--json" in sys.argv[1:]:
        print(json.dumps({name: sorted(set(calls)) for name, calls in paths.items()}))
        return
    for name, calls in paths.items():
        modules = sorted({module for module, _ in calls})
        functions = sorted(set(calls))
        print(f"{name}: {len(modules)} modules, {len(functions)} functions, {len(calls)} calls")
        for module in modules:
            names = sorted(function for mod, function in functions if mod == module)
            print(f"  {module}: {', '.join(names)}")


if __name__ == "__main__":
    main()
