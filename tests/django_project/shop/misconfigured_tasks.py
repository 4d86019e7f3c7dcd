"""Tasks a worker refuses to start with, imported only when a test asks (SHOP_TASK_MODULES)."""

from celery import shared_task

from pglock_celery import TenantLockedTask


@shared_task(base=TenantLockedTask, lock_name="shop:{customer}")
def names_no_argument(tenant: str) -> None:
    """Its lock_name names an argument the task cannot take."""


@shared_task(base=TenantLockedTask, lock_name="shop:{tenant}", lock_mode="block")
def unknown_mode(tenant: str) -> None:
    """Its lock_mode is none of skip, wait, retry."""
