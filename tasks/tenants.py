"""Adding and removing tenants.

Onboarding is serial: every addition holds the shared ``onboarding`` lock
(``lock_mode="wait"``), and the new tenant's pipeline lock for the transaction
that inserts its row (the pipelines table is guarded), in the database of that
lock's shard. Removing a tenant takes that tenant's own pipeline lock, so it
never cuts a running step short.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator

import psycopg

from pglock_celery import AdvisoryLock, TenantLockedTask, current_lock, lock_key, wait_lock

from .celery_app import app
from .schema import PIPELINE_LOCK, TENANT_ID_MAX
from .shards import lock_dsn, tenant_dsn

ONBOARDING_LOCK = "onboarding"


class TenantError(ValueError):
    """A tenant id is invalid, already taken, or unknown."""


def check_tenant_id(tenant_id: object) -> str:
    """Return a valid tenant id or raise TenantError saying what is wrong."""
    if not isinstance(tenant_id, str):
        raise TenantError(f"tenant id must be a str, not {type(tenant_id).__name__}")
    if not tenant_id.strip():
        raise TenantError("tenant id is empty")
    if len(tenant_id) > TENANT_ID_MAX:
        raise TenantError(
            f"tenant id {tenant_id[:20]!r}... is {len(tenant_id)} characters;"
            f" the limit is {TENANT_ID_MAX}"
        )
    return tenant_id


def insert_tenant(conn: psycopg.Connection, tenant_id: str) -> None:
    """Insert a tenant and its pipeline row in one transaction, or change nothing.

    The pipeline row is written under the tenant's pipeline lock, taken on ``conn`` for
    this transaction only (the guard of the pipelines table demands it).
    """
    check_tenant_id(tenant_id)
    with conn.transaction():
        inserted = conn.execute(
            "INSERT INTO tenants (tenant_id) VALUES (%s) ON CONFLICT DO NOTHING RETURNING 1",
            (tenant_id,),
        ).fetchone()
        if inserted is None:
            raise TenantError(f"tenant {tenant_id!r} already exists")
        key = lock_key(PIPELINE_LOCK.format(tenant_id=tenant_id))
        locked = conn.execute("SELECT pg_try_advisory_xact_lock(%s)", (key,)).fetchone()
        if not (locked and locked[0]):
            raise TenantError(f"tenant {tenant_id!r} is locked by a running step")
        conn.execute("INSERT INTO pipelines (tenant_id) VALUES (%s)", (tenant_id,))


@contextlib.contextmanager
def tenant_connections(
    lock: AdvisoryLock, dsn: str | None
) -> Iterator[Callable[[str], psycopg.Connection]]:
    """Yield ``connection_of(tenant_id)``: a connection to the tenant's database, in a
    transaction that commits when the block ends (none does if it raises).

    The database is ``dsn`` when given, else the tenant's shard's. The lock's own
    connection serves the lock's database; another database gets a connection of its own.
    """
    with contextlib.ExitStack() as stack:
        stack.enter_context(lock.connection.transaction())
        connections = {lock.config.require_dsn(): lock.connection}

        def connection_of(tenant_id: str) -> psycopg.Connection:
            where = dsn if dsn is not None else tenant_dsn(check_tenant_id(tenant_id))
            if where not in connections:
                conn = stack.enter_context(psycopg.connect(where, autocommit=True))
                stack.enter_context(conn.transaction())
                connections[where] = conn
            return connections[where]

        yield connection_of


def seed_tenants(dsn: str | None, tenant_ids: list[str]) -> None:
    """Add tenants from outside a worker, under the same onboarding lock: all or none.

    Into the database ``dsn``; with None, each into its shard's database, as the app's
    settings place it (``pglock_shards``, else ``pglock_dsn``'s database alone).
    """
    where = dsn if dsn is not None else lock_dsn(ONBOARDING_LOCK)
    with wait_lock(ONBOARDING_LOCK, dsn=where, timeout=60) as lock:
        with tenant_connections(lock, dsn) as connection_of:
            for tenant_id in tenant_ids:
                insert_tenant(connection_of(tenant_id), tenant_id)


@app.task(base=TenantLockedTask, lock_name=ONBOARDING_LOCK, lock_mode="wait", lock_timeout=120)
def onboard_tenant(tenant_id: str) -> str:
    """Add one tenant, one onboarding at a time across every replica."""
    lock = current_lock()
    assert lock is not None
    conn = lock.connection
    started = conn.execute("SELECT clock_timestamp()").fetchone()
    # Provisioning work (storage, credentials) would happen here.
    conn.execute("SELECT pg_sleep(%s)", (app.conf.orchestrator_step_seconds,))
    with tenant_connections(lock, None) as connection_of:
        insert_tenant(connection_of(tenant_id), tenant_id)
        conn.execute(
            "INSERT INTO onboarding_history (tenant_id, worker_pid, started_at, finished_at)"
            " VALUES (%s, %s, %s, clock_timestamp())",
            (tenant_id, os.getpid(), started[0] if started else None),
        )
    return tenant_id


@app.task(
    base=TenantLockedTask, lock_name="training:{tenant_id}", lock_mode="wait", lock_timeout=120
)
def remove_tenant(tenant_id: str) -> str:
    """Delete a tenant and its pipeline once no step of it runs."""
    lock = current_lock()
    assert lock is not None
    with lock.connection.transaction():
        deleted = lock.connection.execute(
            "DELETE FROM tenants WHERE tenant_id = %s RETURNING 1", (tenant_id,)
        ).fetchone()
    if deleted is None:
        raise TenantError(f"no tenant {tenant_id!r} to remove")
    return tenant_id
