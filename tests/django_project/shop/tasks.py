"""The shop's locked tasks: ORM writes under the tenant's lock (pglock_database = "default")."""

import time
from typing import Any

import psycopg
from celery import shared_task
from django.db import connection, transaction
from psycopg import sql

from pglock_celery import TenantLockedTask, current_lock
from pglock_celery.django import dsn

from .models import Ledger, Note

#: The guarded table's lock name too (installed by the tests).
LOCK = "shop:{tenant}"

#: Seconds a body waits for the test's go before it gives up.
GO_TIMEOUT = 60.0


@shared_task(base=TenantLockedTask, lock_name=LOCK)
def record(tenant: str, entry: str) -> dict[str, Any]:
    """One row in autocommit, one in atomic(), one in a savepoint rolled back; all read back."""
    lock = current_lock()
    assert lock is not None
    Ledger.objects.create(tenant=tenant, entry=entry, data={"how": "autocommit"})
    with transaction.atomic():
        Ledger.objects.create(tenant=tenant, entry=entry, data={"how": "atomic"})
        try:
            with transaction.atomic():
                Ledger.objects.create(tenant=tenant, entry=entry, data={"how": "rolled back"})
                raise LookupError
        except LookupError:
            pass
    rows = list(Ledger.objects.filter(tenant=tenant).order_by("id"))
    return {
        "backend_pid": lock.backend_pid,
        "writers": sorted({row.backend for row in rows}),
        "data": [row.data for row in rows],
        "aware": all(row.written_at.tzinfo is not None for row in rows),
    }


@shared_task(base=TenantLockedTask, lock_name=LOCK)
def unlock_then_write(tenant: str) -> bool:
    """The body's own SQL, through the ORM, tries to free its lock; then it writes a note.

    Returns whether the lock is still held after that statement.
    """
    lock = current_lock()
    assert lock is not None
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_advisory_unlock_all()")
    Note.objects.create(tenant=tenant, text="after the unlock")
    return lock.held()


@shared_task(base=TenantLockedTask, lock_name=LOCK)
def record_across_a_loss(tenant: str, beacon: str, inside_atomic: bool) -> None:
    """Write, tell the test the lock's backend, wait for its go (it ends that backend), write.

    The beacon is a table the test made, reached on a plain connection of its own.
    """
    lock = current_lock()
    assert lock is not None
    with psycopg.connect(dsn("default"), autocommit=True) as side:
        if inside_atomic:
            with transaction.atomic():
                Ledger.objects.create(tenant=tenant, entry="before")
                _signal_and_wait(side, beacon, tenant, lock.backend_pid)
                Ledger.objects.create(tenant=tenant, entry="after")
        else:
            Ledger.objects.create(tenant=tenant, entry="before")
            _signal_and_wait(side, beacon, tenant, lock.backend_pid)
            Ledger.objects.create(tenant=tenant, entry="after")


def _signal_and_wait(
    side: psycopg.Connection[Any], beacon: str, tenant: str, backend_pid: int | None
) -> None:
    table = sql.Identifier(beacon)
    side.execute(
        sql.SQL("INSERT INTO {} (tenant, backend_pid) VALUES (%s, %s)").format(table),
        (tenant, backend_pid),
    )
    deadline = time.monotonic() + GO_TIMEOUT
    query = sql.SQL("SELECT go FROM {} WHERE tenant = %s").format(table)
    while time.monotonic() < deadline:
        row = side.execute(query, (tenant,)).fetchone()
        if row is not None and row[0]:
            return
        time.sleep(0.02)
    raise TimeoutError("the test never said go")
