"""Task bodies for the guarded-table tests: the core test app plus bodies that write a
guarded table the right way and the wrong ways. Their workers listen on a queue of their
own (PGLOCK_TEST_QUEUE), so that the core workers never see these tasks.
"""

from __future__ import annotations

import os
import time
from typing import Any

import psycopg
from psycopg import sql

from pglock_celery import TenantLockedTask, current_lock
from tests.apps.core import app

GUARD_LOCK = "guard:{tenant_id}"


def _bump(conn: psycopg.Connection, table: str, tenant_id: str) -> None:
    conn.execute(
        sql.SQL("UPDATE {} SET n = n + 1 WHERE tenant_id = %s").format(
            sql.Identifier(*table.split("."))
        ),
        (tenant_id,),
    )


def _fresh_write(table: str, tenant_id: str) -> str:
    """Write through a connection of its own: 'committed', or the refusal's SQLSTATE."""
    with psycopg.connect(os.environ["PGLOCK_DSN"], autocommit=True) as other:
        try:
            _bump(other, table, tenant_id)
        except psycopg.Error as exc:
            return str(exc.sqlstate)
    return "committed"


@app.task(base=TenantLockedTask, lock_name=GUARD_LOCK)
def guarded_write(tenant_id: str, table: str, through: str) -> str:
    """Bump the tenant's row through the lock's connection ("lock") or another ("other")."""
    if through == "other":
        return _fresh_write(table, tenant_id)
    lock = current_lock()
    assert lock is not None
    with lock.connection.transaction():
        _bump(lock.connection, table, tenant_id)
    return "committed"


@app.task(base=TenantLockedTask, lock_name=GUARD_LOCK)
def write_across_a_kill(tenant_id: str, table: str, signal_key: str) -> dict[str, Any]:
    """Bump the row in a transaction on the lock's connection, let the test terminate the
    lock session, then try to commit, then try again through a fresh connection (the
    "reconnect and retry" a careless body might do). Outcomes go to Redis: the task
    itself fails at release, its lock being lost.
    """
    client = app.backend.client
    lock = current_lock()
    assert lock is not None
    outcome: dict[str, Any] = {}
    try:
        with lock.connection.transaction():
            _bump(lock.connection, table, tenant_id)
            row = lock.connection.execute("SELECT pg_backend_pid()").fetchone()
            assert row is not None
            client.set(f"{signal_key}:pid", row[0])
            deadline = time.monotonic() + 30
            while not client.get(f"{signal_key}:killed") and time.monotonic() < deadline:
                time.sleep(0.05)
        outcome["commit"] = "committed"
    except psycopg.Error as exc:
        outcome["commit"] = f"failed: {type(exc).__name__}"
    outcome["fresh"] = _fresh_write(table, tenant_id)
    client.hset(f"{signal_key}:outcome", mapping=outcome)
    return outcome
