"""Tasks whose lock is lost mid-step, each finding the loss another way (real workers).

Loaded by a worker as ``-A tests.apps.losses``: the tasks join the core app. A step
records its start (the lock session's backend, for the test to end it), then waits
for the test's Redis marker (set once the backend was ended, but for ``"proof"``),
then meets the loss the way its ``found_by`` says:

- ``"monitor"``: keeps running (short sleeps) until the monitor finds the loss and
  interrupts it;
- ``"held"``: asks ``lock.ensure_held()``;
- ``"transaction"``: opens ``lock.transaction()``, which finds the session failed;
- ``"proof"``: (the session lives on) unlocks its own lock with SQL on
  ``lock.connection``, then opens ``lock.transaction()``, whose proof finds it gone;
- ``"release"``: returns, so the loss is found when the call releases the lock.

Workers that run all but the first are started with a check interval far longer than
the test, so the monitor never finds the loss first.
"""

from __future__ import annotations

import time
from typing import Any

from pglock_celery import TenantLockedTask, current_lock
from tests.apps.core import _marker, _record_start, app

__all__ = ["app", "lose"]

#: The most a step waits for its marker, or for the monitor's interrupt.
PATIENCE = 30.0


@app.task(base=TenantLockedTask, reject_on_worker_lost=False, acks_late=False)
def lose(tenant_id: str, table: str, marker: str, found_by: str) -> dict[str, Any]:
    """Lose the lock mid-step and meet the loss as ``found_by`` says (module docstring)."""
    lock = current_lock()
    assert lock is not None
    _record_start(table)
    deadline = time.monotonic() + PATIENCE
    while not _marker().exists(marker) and time.monotonic() < deadline:
        time.sleep(0.01)
    if found_by == "monitor":
        while time.monotonic() < deadline:
            time.sleep(0.01)  # short: the threads pool's interrupt comes between bytecodes
    elif found_by == "held":
        lock.ensure_held()
    elif found_by == "proof":
        lock.connection.execute("SELECT pg_catalog.pg_advisory_unlock_all()")
        with lock.transaction() as conn:
            conn.execute("SELECT 1")
    elif found_by == "transaction":
        with lock.transaction() as conn:
            conn.execute("SELECT 1")
    return {"ran": True, "found_by": found_by}
