"""Bad arguments raise errors that are ours and the builtin a Python user catches.

A wrong type is a TypeError, a wrong value a ValueError, and each is a PglockError:
``except ValueError`` and ``except PglockError`` both catch them. Nothing connects.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest

from pglock_celery import LockNameError, PglockError, lock_key, try_lock, wait_lock
from pglock_celery.exceptions import LockArgumentError, LockArgumentTypeError

NOWHERE = "host=127.0.0.1 port=1 dbname=none connect_timeout=1"


@pytest.mark.parametrize("bad", [None, True, False, 1.5, b"t:1", ["t:1"]])
def test_a_lock_that_is_neither_a_name_nor_a_key_is_a_type_error(bad: Any) -> None:
    for make in (try_lock, wait_lock):
        with pytest.raises(TypeError) as raised:
            make(bad, dsn=NOWHERE)
        assert isinstance(raised.value, PglockError)
        assert isinstance(raised.value, LockArgumentTypeError)
        assert type(bad).__name__ in str(raised.value)


@pytest.mark.parametrize("bad", [dt.timedelta(seconds=1), "1", True, [1], object()])
def test_a_timeout_that_is_not_a_number_is_a_type_error(bad: Any) -> None:
    with pytest.raises(TypeError, match="lock timeout must be a number of seconds") as raised:
        wait_lock("t", dsn=NOWHERE, timeout=bad)
    assert isinstance(raised.value, PglockError)


@pytest.mark.parametrize("bad", [-1, -0.001, float("nan"), float("inf"), 1e10])
def test_a_timeout_postgres_cannot_apply_is_a_value_error(bad: float) -> None:
    with pytest.raises(ValueError, match="lock timeout") as raised:
        wait_lock("t", dsn=NOWHERE, timeout=bad)
    assert isinstance(raised.value, PglockError)
    assert isinstance(raised.value, LockArgumentError)


@pytest.mark.parametrize("bad", ["", "a\x00b"])
def test_a_name_postgres_cannot_take_is_a_value_error_and_a_lock_name_error(bad: str) -> None:
    for make in (try_lock, wait_lock):
        with pytest.raises(ValueError) as raised:
            make(bad, dsn=NOWHERE)
        assert isinstance(raised.value, LockNameError)
        assert isinstance(raised.value, PglockError)


@pytest.mark.parametrize("bad", [2**63, -(2**63) - 1, 2**64])
def test_a_key_outside_64_bits_is_a_value_error(bad: int) -> None:
    with pytest.raises(ValueError, match="outside the signed 64-bit range") as raised:
        try_lock(bad, dsn=NOWHERE)
    assert isinstance(raised.value, PglockError)


@pytest.mark.parametrize("bad", [42, None, b"x"])
def test_lock_key_of_a_non_str_stays_a_type_error_and_is_ours_too(bad: Any) -> None:
    with pytest.raises(TypeError) as raised:
        lock_key(bad)
    assert isinstance(raised.value, PglockError)


def test_the_argument_errors_are_where_the_tree_says() -> None:
    assert issubclass(LockNameError, LockArgumentError)
    assert issubclass(LockArgumentError, ValueError) and issubclass(LockArgumentError, PglockError)
    assert issubclass(LockArgumentTypeError, TypeError)
    assert issubclass(LockArgumentTypeError, PglockError)
    assert not issubclass(LockArgumentTypeError, ValueError)
