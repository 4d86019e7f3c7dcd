"""Where a tenant's rows live: in the database of its pipeline lock's shard.

With ``pglock_shards`` each shard's database holds a whole copy of the
orchestrator's schema, and a tenant's rows (its tenant and pipeline rows, its step
history, its training jobs) live in the one that its lock ``training:{tenant_id}``
lives on: a step writes them through its lock's own connection, and the guard of
its tables checks the lock where it is held. Without shards, ``pglock_dsn``'s
database holds every tenant.
"""

from __future__ import annotations

from pglock_celery import lock_key
from pglock_celery.config import get_config

from .celery_app import app
from .schema import PIPELINE_LOCK


def lock_dsn(name: str) -> str:
    """The DSN of the database that the lock ``name`` lives on: its shard's."""
    return get_config(app).for_key(lock_key(name), name).require_dsn()


def tenant_dsn(tenant_id: str) -> str:
    """The DSN of the database that holds the tenant's rows: its pipeline lock's.

    Inside a step, ``current_lock().config.dsn`` is the same DSN.
    """
    return lock_dsn(PIPELINE_LOCK.format(tenant_id=tenant_id))


def shard_dsns() -> dict[str, str]:
    """Every shard's name and DSN; ``{"default": pglock_dsn}`` without shards."""
    return {name: config.require_dsn() for name, config in get_config(app).each_shard()}
