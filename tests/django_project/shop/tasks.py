"""The shop's locked tasks: ORM writes under the tenant's lock (pglock_database = "default")."""

import asyncio
import tempfile
import time
from typing import Any

import psycopg
from asgiref.sync import async_to_sync, sync_to_async
from celery import shared_task
from django.db import connection, transaction
from psycopg import pq, sql

from pglock_celery import LockLost, PglockError, TenantLockedTask, current_lock
from pglock_celery.django import dsn

from .models import Ledger, Note
from .signals import paid

#: The guarded table's lock name too (installed by its migration 0002).
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
def record_through_signals(tenant: str) -> dict[str, Any]:
    """A "signalled" entry, whose post_save receiver writes an "audit" one, in autocommit
    and then in atomic(); and the "paid" signal, whose receiver writes a note."""
    lock = current_lock()
    assert lock is not None
    Ledger.objects.create(tenant=tenant, entry="signalled")
    with transaction.atomic():
        Ledger.objects.create(tenant=tenant, entry="signalled")
        paid.send(sender=None, tenant=tenant)
    return {"backend_pid": lock.backend_pid}


@shared_task(base=TenantLockedTask, lock_name=LOCK)
def one_write_traced(tenant: str, zone: str | None = None) -> list[list[str]]:
    """One row created in autocommit, the lock session's protocol traced by libpq
    meanwhile: every message the client sent, as [type, text]. With ``zone``, the
    session is moved to it first (through lock.connection, outside the trace)."""
    lock = current_lock()
    assert lock is not None
    if zone is not None:
        lock.connection.execute(sql.SQL("SET TimeZone = {}").format(sql.Literal(zone)))
    pgconn = lock.connection.pgconn
    with tempfile.TemporaryFile("w+") as trace:
        pgconn.trace(trace.fileno())
        pgconn.set_trace_flags(pq.Trace.SUPPRESS_TIMESTAMPS | pq.Trace.REGRESS_MODE)
        try:
            Note.objects.create(tenant=tenant, text="traced")
        finally:
            pgconn.untrace()
        trace.seek(0)
        lines = [line.split("\t") for line in trace.read().splitlines()]
    return [fields[2:4] for fields in lines if fields[0] == "F" and len(fields) > 2]


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


@shared_task(base=TenantLockedTask, lock_name=LOCK, lock_mode="wait", lock_timeout=120)
def write_while_another_call_waits(tenant: str, beacon: str) -> dict[str, Any]:
    """Tell the test the lock's backend, wait for its go (a waiter on this lock in this
    process meanwhile), then write: a note (unguarded), then a ledger row (guarded).

    Returns the lock's backend, the backend the ORM's note went through, and what the
    ledger write did.
    """
    lock = current_lock()
    assert lock is not None
    with psycopg.connect(dsn("default"), autocommit=True) as side:
        _signal_and_wait(side, beacon, tenant, lock.backend_pid)
    Note.objects.create(tenant=tenant, text="holder")
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        (orm_backend,) = cursor.fetchone()
    try:
        Ledger.objects.create(tenant=tenant, entry="holder")
        ledger = "written"
    except Exception as exc:
        ledger = f"{type(exc).__name__}: {exc}"
    return {"backend_pid": lock.backend_pid, "orm_backend": orm_backend, "ledger": ledger}


@shared_task(base=TenantLockedTask, lock_name=LOCK, lock_mode="wait", lock_timeout=120)
def write_once_it_is_my_turn(tenant: str) -> int | None:
    """A waiter on the tenant's lock: once granted, one ledger row; returns its backend."""
    lock = current_lock()
    assert lock is not None
    Ledger.objects.create(tenant=tenant, entry="waiter")
    return lock.backend_pid


@shared_task(base=TenantLockedTask, lock_name=LOCK)
def write_through_asgiref_hops(tenant: str) -> dict[str, Any]:
    """The async ORM from sync code, each way asgiref moves it to another thread:
    asyncio.run() of acreate(), of a coroutine awaiting sync_to_async(f) (thread
    sensitive or not), and async_to_sync. Returns each row's writer, read back."""
    lock = current_lock()
    assert lock is not None

    def create(entry: str) -> None:
        Ledger.objects.create(tenant=tenant, entry=entry)

    async def hop(sensitive: bool) -> None:
        await sync_to_async(create, thread_sensitive=sensitive)(f"sync_to_async {sensitive}")

    async def in_a_loop() -> None:
        await Ledger.objects.acreate(tenant=tenant, entry="async_to_sync")

    asyncio.run(Ledger.objects.acreate(tenant=tenant, entry="acreate"))
    asyncio.run(hop(True))
    asyncio.run(hop(False))
    async_to_sync(in_a_loop)()
    rows = Ledger.objects.filter(tenant=tenant).order_by("id").values_list("entry", "backend")
    return {"backend_pid": lock.backend_pid, "rows": [list(row) for row in rows]}


@shared_task(base=TenantLockedTask, lock_name=LOCK)
def async_writes_after_the_loss(tenant: str, beacon: str) -> dict[str, str]:
    """Once the loss is found (the interrupt caught), notes through the async ORM under
    asyncio.run(): acreate(), and sync_to_async(f) with its default thread_sensitive."""
    lock = current_lock()
    assert lock is not None
    with psycopg.connect(dsn("default"), autocommit=True) as side:
        try:
            _signal_and_wait(side, beacon, tenant, lock.backend_pid)
            deadline = time.monotonic() + GO_TIMEOUT
            while lock.loss is None and time.monotonic() < deadline:
                time.sleep(0.02)
        except LockLost:
            pass  # the interrupt: what the body writes after it must not commit either
    assert lock.loss is not None

    async def through_sync_to_async() -> None:
        await sync_to_async(Note.objects.create)(tenant=tenant, text="sync_to_async")

    seen = {}
    for how, write in (
        ("acreate", lambda: Note.objects.acreate(tenant=tenant, text="acreate")),
        ("sync_to_async", through_sync_to_async),
    ):
        try:
            asyncio.run(write())
            seen[how] = "written"
        except Exception as exc:
            seen[how] = type(exc).__name__
    return seen


@shared_task(base=TenantLockedTask, lock_name=LOCK)
def async_orm_inside_atomic(tenant: str) -> str:
    """Inside the body's atomic() block, a note through acreate() under asyncio.run()
    (asgiref's thread, while the body's transaction is open). Returns what it got."""
    with transaction.atomic():
        Note.objects.create(tenant=tenant, text="in the block")
        try:
            asyncio.run(Note.objects.acreate(tenant=tenant, text="acreate"))
        except PglockError as exc:
            return str(exc)
    return "written"


def _orm_writes(tenant: str) -> dict[str, Any]:
    """Each way of the ORM to write (the features a Django project uses), by name: each
    writes a note "after", or changes or deletes the note "before"."""
    from django.db import close_old_connections

    def create() -> None:
        Note.objects.create(tenant=tenant, text="after")

    def in_atomic() -> None:
        with transaction.atomic():
            create()

    def nested_atomic() -> None:
        with transaction.atomic(), transaction.atomic():
            create()

    def savepoint() -> None:
        with transaction.atomic():
            point = transaction.savepoint()
            create()
            transaction.savepoint_commit(point)

    def on_commit() -> None:
        with transaction.atomic():
            transaction.on_commit(create)
            Note.objects.filter(tenant=tenant).exists()

    def select_for_update() -> None:
        with transaction.atomic():
            list(Note.objects.select_for_update().filter(tenant=tenant))
            create()

    def bulk_update() -> None:
        notes = list(Note.objects.filter(tenant=tenant))
        for note in notes:
            note.text = "after"
        Note.objects.bulk_update(notes, ["text"])

    def raw_sql() -> None:
        with connection.cursor() as cursor:
            cursor.execute(
                "INSERT INTO shop_note (tenant, text) VALUES (%s, %s)", [tenant, "after"]
            )

    def manual_transaction() -> None:
        transaction.set_autocommit(False)
        try:
            create()
            transaction.commit()
        finally:
            transaction.set_autocommit(True)

    def after_close_old_connections() -> None:
        close_old_connections()
        create()

    def after_connection_close() -> None:
        connection.close()
        create()

    async def acreate() -> None:
        await Note.objects.acreate(tenant=tenant, text="after")

    return {
        "create": create,
        "atomic": in_atomic,
        "nested atomic": nested_atomic,
        "savepoint": savepoint,
        "on_commit": on_commit,
        "select_for_update": select_for_update,
        "bulk_create": lambda: Note.objects.bulk_create([Note(tenant=tenant, text="after")]),
        "bulk_update": bulk_update,
        "update_or_create": lambda: Note.objects.update_or_create(
            tenant=tenant, text="before", defaults={"text": "after"}
        ),
        "get_or_create": lambda: Note.objects.get_or_create(tenant=tenant, text="after"),
        "update": lambda: Note.objects.filter(tenant=tenant).update(text="after"),
        "delete": lambda: Note.objects.filter(tenant=tenant).delete(),
        "raw sql": raw_sql,
        "set_autocommit": manual_transaction,
        "close_old_connections": after_close_old_connections,
        "connection.close": after_connection_close,
        "signal receiver": lambda: paid.send(sender=None, tenant=tenant),
        "asyncio.run(acreate)": lambda: asyncio.run(acreate()),
        "async_to_sync(acreate)": lambda: async_to_sync(acreate)(),
    }


@shared_task(base=TenantLockedTask, lock_name=LOCK)
def orm_writes_after_the_loss(tenant: str, beacon: str, outcomes: str) -> None:
    """A note "before"; once the loss is found (the interrupt caught), every way of
    _orm_writes, each outcome recorded in the table ``outcomes`` by a side session."""
    lock = current_lock()
    assert lock is not None
    Note.objects.create(tenant=tenant, text="before")
    with psycopg.connect(dsn("default"), autocommit=True) as side:
        try:
            _signal_and_wait(side, beacon, tenant, lock.backend_pid)
            deadline = time.monotonic() + GO_TIMEOUT
            while lock.loss is None and time.monotonic() < deadline:
                time.sleep(0.02)
        except LockLost:
            pass  # the interrupt: what the body writes after it must not commit either
        assert lock.loss is not None
        record = sql.SQL("INSERT INTO {} (feature, outcome) VALUES (%s, %s)").format(
            sql.Identifier(outcomes)
        )
        for feature, write in _orm_writes(tenant).items():
            try:
                write()
                outcome = "written"
            except Exception as exc:
                outcome = type(exc).__name__
            side.execute(record, (feature, outcome))
