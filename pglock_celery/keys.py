"""Lock names -> signed 64-bit advisory lock keys, and what a name or a wait may be.

The checks raise errors that are both ours and the builtin a caller expects: a
wrong type is a LockArgumentTypeError (a TypeError), a wrong value a
LockArgumentError or LockNameError (ValueErrors); all are PglockErrors.
"""

from __future__ import annotations

import functools
import hashlib
import math

from .exceptions import LockArgumentError, LockArgumentTypeError, LockNameError

_BIGINT_MAX = 2**63 - 1
_UINT32_MASK = 0xFFFFFFFF
#: The longest wait Postgres' lock_timeout takes, in seconds.
MAX_TIMEOUT = (2**31 - 1) / 1000


def lock_key(name: str) -> int:
    """Return the advisory lock key for ``name``.

    The formula is the one hand-rolled code already uses, so old and new
    replicas exclude each other during a migration: the first 16 hex digits of
    the name's UTF-8 MD5, minus ``2**63 - 1``. The single digest that would
    give ``2**63`` (outside bigint) wraps to ``-2**63``.
    """
    if not isinstance(name, str):
        raise LockArgumentTypeError(f"lock name must be a str, not {type(name).__name__}")
    digest = hashlib.md5(name.encode(), usedforsecurity=False).hexdigest()
    key = int(digest[:16], 16) - _BIGINT_MAX
    if key > _BIGINT_MAX:
        key -= 2**64
    return key


#: lock_key() for names met again and again (a tenant's every step).
cached_lock_key = functools.lru_cache(maxsize=4096)(lock_key)


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
    """Return ``key`` if it fits a Postgres bigint.

    Raises LockArgumentTypeError for anything but an int (a bool too: ``True``
    is a mistake, not key 1), LockArgumentError for an int outside 64 bits.
    """
    if isinstance(key, bool) or not isinstance(key, int):
        raise LockArgumentTypeError(f"a lock is a str name or an int key, not {type(key).__name__}")
    if not -(2**63) <= key <= _BIGINT_MAX:
        raise LockArgumentError(f"lock key {key} is outside the signed 64-bit range")
    return key


def check_lock_name(name: str) -> str:
    """Return ``name`` if it can name a lock.

    Raises LockArgumentTypeError for anything but a str, LockNameError for a
    name Postgres cannot carry (empty, or holding a NUL).
    """
    if not isinstance(name, str):
        raise LockArgumentTypeError(f"a lock name must be a str, not {type(name).__name__}")
    if not name:
        raise LockNameError("a lock name may not be empty")
    if "\x00" in name:
        raise LockNameError(f"lock name {name!r} holds a NUL character, which Postgres refuses")
    return name


def check_timeout(timeout: float | None) -> float | None:
    """Return a wait timeout in seconds if Postgres can apply it.

    Raises LockArgumentTypeError for anything but an int or float (a
    ``timedelta``, a str, a bool), LockArgumentError for a negative, NaN or
    too long one.
    """
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise LockArgumentTypeError(
            f"lock timeout must be a number of seconds (int or float) or None, not {timeout!r}"
        )
    if math.isnan(timeout) or timeout < 0:
        raise LockArgumentError(f"lock timeout must be 0 or more seconds, got {timeout!r}")
    if timeout > MAX_TIMEOUT:
        raise LockArgumentError(
            f"lock timeout must be at most {MAX_TIMEOUT:.0f} s (Postgres' lock_timeout), "
            f"got {timeout!r}; use None to wait without a bound"
        )
    return float(timeout)
