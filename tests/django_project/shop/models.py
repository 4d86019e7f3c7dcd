"""A guarded table (`shop_ledger`, lock name "shop:{tenant}", installed by the tests), and not."""

from django.db import models
from django.utils import timezone


class Ledger(models.Model):
    tenant = models.CharField(max_length=64)
    entry = models.CharField(max_length=64)
    #: The backend that wrote the row: the lock's session, for a task's write.
    backend = models.IntegerField(
        db_default=models.Func(function="pg_backend_pid", output_field=models.IntegerField())
    )
    written_at = models.DateTimeField(default=timezone.now)
    data = models.JSONField(default=dict)


class Note(models.Model):
    """Not guarded: only the fence keeps its writes under the lock."""

    tenant = models.CharField(max_length=64)
    text = models.CharField(max_length=200)
