"""Lock names -> signed 64-bit advisory lock keys."""

from __future__ import annotations

import hashlib

_BIGINT_MAX = 2**63 - 1
_UINT32_MASK = 0xFFFFFFFF


def lock_key(name: str) -> int:
    """Return the advisory lock key for ``name``.

    The formula is the one hand-rolled code already uses, so old and new
    replicas exclude each other during a migration: the first 16 hex digits of
    the name's UTF-8 MD5, minus ``2**63 - 1``. The single digest that would
    give ``2**63`` (outside bigint) wraps to ``-2**63``.
    """
    if not isinstance(name, str):
        raise TypeError(f"lock name must be a str, not {type(name).__name__}")
    digest = hashlib.md5(name.encode(), usedforsecurity=False).hexdigest()
    key = int(digest[:16], 16) - _BIGINT_MAX
    if key > _BIGINT_MAX:
        key -= 2**64
    return key


def key_to_lock_fields(key: int) -> tuple[int, int]:
    """Return ``(classid, objid)``: how ``pg_locks`` shows a bigint advisory key.

    Postgres stores the high and low 32 bits of the key as unsigned oids, with
    ``objsubid = 1`` marking the single-bigint form.
    """
    unsigned = key & 0xFFFFFFFFFFFFFFFF
    return unsigned >> 32, unsigned & _UINT32_MASK


def lock_fields_to_key(classid: int, objid: int) -> int:
    """Return the signed bigint key that ``pg_locks`` shows as (classid, objid)."""
    unsigned = (classid << 32) | objid
    return unsigned - 2**64 if unsigned > _BIGINT_MAX else unsigned


def check_key(key: int) -> int:
    """Return ``key`` if it fits a Postgres bigint, else raise ValueError."""
    if isinstance(key, bool) or not isinstance(key, int):
        raise TypeError(f"lock key must be an int, not {type(key).__name__}")
    if not -(2**63) <= key <= _BIGINT_MAX:
        raise ValueError(f"lock key {key} is outside the signed 64-bit range")
    return key
