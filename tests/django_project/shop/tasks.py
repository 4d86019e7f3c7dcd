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


@shared_task(base=TenantLockedTask, lock_name=LOCK)
def sql_past_the_wrapper(tenant: str) -> dict[str, Any]:
    """SQL sent around Django's execute(): psycopg's stream(), copy(), the raw cursor.

    The first frees the lock if it can; a side session then tries the lock. Returns
    what it got, and whether the body's lock is still held at the end.
    """
    lock = current_lock()
    assert lock is not None
    with connection.cursor() as cursor:
        list(cursor.stream("SELECT pg_advisory_unlock_all()"))
        with psycopg.connect(dsn("default"), autocommit=True) as side:
            row = side.execute("SELECT pg_try_advisory_lock(%s)", (lock.key,)).fetchone()
            other_got = bool(row and row[0])
        with cursor.copy("COPY shop_note (tenant, text) FROM STDIN") as copy:
            copy.write_row((tenant, "copied"))
        cursor.cursor.execute("INSERT INTO shop_note (tenant, text) VALUES (%s, 'raw')", (tenant,))
    return {"other_got": other_got, "held": lock.held()}


@shared_task(base=TenantLockedTask, lock_name=LOCK)
def copy_in_a_rolled_back_atomic(tenant: str) -> None:
    """A COPY as the first statement of an atomic() block that then fails."""
    try:
        with transaction.atomic():
            with connection.cursor() as cursor:
                with cursor.copy("COPY shop_note (tenant, text) FROM STDIN") as copy:
                    copy.write_row((tenant, "copied"))
            Note.objects.create(tenant=tenant, text="created")
            raise LookupError
    except LookupError:
        pass


@shared_task(base=TenantLockedTask, lock_name=LOCK)
def commit_by_sql(tenant: str) -> dict[str, str]:
    """Inside atomic(): a write, then COMMIT through a cursor, then another write."""
    seen: dict[str, str] = {}
    try:
        with transaction.atomic():
            Note.objects.create(tenant=tenant, text="before")
            for step, statement in (
                ("commit", "COMMIT"),
                ("unlock", "SELECT pg_advisory_unlock_all()"),
            ):
                try:
                    with connection.cursor() as cursor:
                        cursor.execute(statement)
                    seen[step] = "ran"
                except Exception as exc:
                    seen[step] = type(exc).__name__
            try:
                Note.objects.create(tenant=tenant, text="after")
                seen["after"] = "ran"
            except Exception as exc:
                seen["after"] = type(exc).__name__
    except Exception as exc:
        seen["atomic"] = type(exc).__name__
    lock = current_lock()
    assert lock is not None
    seen["held"] = str(lock.held())
    return seen


@shared_task(base=TenantLockedTask, lock_name=LOCK)
def call_another_tenants_step(tenant: str) -> dict[str, Any]:
    """Call another tenant's locked task directly from this body: its lock fences its writes."""
    return record(f"{tenant}-inner", "inner")


@shared_task(base=TenantLockedTask, lock_name=LOCK)
def read_across_a_loss(tenant: str, beacon: str) -> int:
    """Read through a server-side cursor (.iterator()), its session ended mid-read."""
    lock = current_lock()
    assert lock is not None
    for text in ("one", "two", "three"):
        Note.objects.create(tenant=tenant, text=text)
    read = 0
    with psycopg.connect(dsn("default"), autocommit=True) as side:
        with transaction.atomic():
            for _note in Note.objects.filter(tenant=tenant).iterator(chunk_size=1):
                read += 1
                if read == 1:
                    _signal_and_wait(side, beacon, tenant, lock.backend_pid)
    return read
