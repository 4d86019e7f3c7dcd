"""The shop's signals: where a Django project hangs the writes that follow a write."""

from typing import Any

from django.db.models.signals import post_save
from django.dispatch import Signal, receiver

from .models import Ledger, Note

#: Sent by a body once a tenant's order is paid; its receiver writes a note.
paid = Signal()


@receiver(post_save, sender=Ledger)
def audit_a_signalled_entry(
    sender: type[Ledger], instance: Ledger, created: bool, **_: Any
) -> None:
    """A new "signalled" entry leaves an "audit" entry beside it (a write in a receiver)."""
    if created and instance.entry == "signalled":
        Ledger.objects.create(tenant=instance.tenant, entry="audit")


@receiver(paid)
def note_the_payment(sender: object, tenant: str, **_: Any) -> None:
    Note.objects.create(tenant=tenant, text="after")
