"""lock_key: the seed-compatible formula, pinned by golden vectors."""

from __future__ import annotations

import random
from unittest import mock

import pytest

from pglock_celery import lock_key
from pglock_celery.keys import check_key, key_to_lock_fields, lock_fields_to_key

# Computed by hand: int(md5(name)[:16], 16) - (2**63 - 1).
GOLDEN = {
    "tenant:42": -8502700072172048958,  # md5 prefix 0a005755667f2dc1
    "training:1": -7042588602537560222,  # 1e43b2faae88b761
    "onboarding": -2473438498314158386,  # 5dac94ca66357ecd
    "": 6061155539545534981,  # d41d8cd98f00b204
    "é": -1811065423221838925,  # 66ddcd97cfdeabb2, UTF-8 encoded
}


@pytest.mark.parametrize(("name", "key"), GOLDEN.items())
def test_golden_vectors(name: str, key: int) -> None:
    assert lock_key(name) == key


@pytest.mark.parametrize(
    ("prefix", "key"),
    [
        ("ffffffffffffffff", -(2**63)),  # would be 2**63: wraps
        ("fffffffffffffffe", 2**63 - 1),
        ("0000000000000000", -(2**63 - 1)),
    ],
)
def test_digest_extremes_stay_inside_bigint(prefix: str, key: int) -> None:
    digest = mock.Mock(hexdigest=mock.Mock(return_value=prefix + "0" * 16))
    with mock.patch("pglock_celery.keys.hashlib.md5", return_value=digest):
        assert lock_key("anything") == key


@pytest.mark.parametrize(
    ("bad", "kind"), [(42, "int"), (b"tenant:42", "bytes"), (None, "NoneType"), (4.2, "float")]
)
def test_non_str_names_raise_type_error_naming_the_type(bad: object, kind: str) -> None:
    with pytest.raises(TypeError, match=f"^lock name must be a str, not {kind}$"):
        lock_key(bad)  # type: ignore[arg-type]


def test_pg_locks_fields_round_trip_for_every_sign() -> None:
    rng = random.Random(7)
    keys = [0, 1, -1, 2**63 - 1, -(2**63), *(rng.randint(-(2**63), 2**63 - 1) for _ in range(200))]
    for key in keys:
        classid, objid = key_to_lock_fields(key)
        assert 0 <= classid < 2**32 and 0 <= objid < 2**32
        assert lock_fields_to_key(classid, objid) == key


def test_negative_key_maps_to_high_classid() -> None:
    assert key_to_lock_fields(-1) == (0xFFFFFFFF, 0xFFFFFFFF)
    assert key_to_lock_fields(-(2**63)) == (0x80000000, 0)


@pytest.mark.parametrize("bad", [2**63, -(2**63) - 1])
def test_keys_outside_bigint_are_refused(bad: int) -> None:
    with pytest.raises(ValueError, match="64-bit"):
        check_key(bad)


@pytest.mark.parametrize("key", [-(2**63), 2**63 - 1, 0])
def test_keys_at_the_ends_of_bigint_are_accepted(key: int) -> None:
    assert check_key(key) == key


@pytest.mark.parametrize(("bad", "kind"), [(True, "bool"), ("42", "str"), (4.0, "float")])
def test_a_key_that_is_not_an_int_raises_type_error_naming_the_type(bad: object, kind: str) -> None:
    with pytest.raises(TypeError, match=f"^a lock is a str name or an int key, not {kind}$"):
        check_key(bad)  # type: ignore[arg-type]
