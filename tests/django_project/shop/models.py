"""A guarded table (`shop_ledger`, lock "shop:{tenant}", guarded by migration 0002), and not."""

from django.db import models
from django.utils import timezone


class Ledger(models.Model):
    tenant = models.CharField(max_length=64)
    entry = models.CharField(max_length=64)
    #: The backend that wrote the row: the lock's session, for a task's write (set by the
    #: table's own trigger, migration 0001: Django 4.2 has no db_default).
    backend = models.IntegerField(null=True)
    written_at = models.DateTimeField(default=timezone.now)
    data = models.JSONField(default=dict)


class Note(models.Model):
    """Not guarded: only the fence keeps its writes under the lock."""

    tenant = models.CharField(max_length=64)
    text = models.CharField(max_length=200)
