"""Which shard a lock lives on (shards.py, PglockConfig.shard_of): the setting, the rule
of rendezvous hashing and what moves when shards come and go, the user's rule."""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pglock_celery.config import PglockConfig, load_config
from pglock_celery.exceptions import ConfigurationError, LockNameError
from pglock_celery.keys import lock_key
from pglock_celery.shards import DEFAULT, Shard, parse_shards, rendezvous

THREE = {"a": "host=pg-a dbname=app", "b": "host=pg-b dbname=app", "c": "host=pg-c dbname=app"}
KEYS = [lock_key(f"tenant:{i}") for i in range(6000)]


def test_a_mapping_of_names_to_dsns_or_to_dsn_and_patroni_urls_is_read_in_every_form() -> None:
    shards = parse_shards(
        {
            "a": "host=pg-a",
            "b": {"dsn": "host=pg-b", "patroni_url": "http://pg-b1:8008,http://pg-b2:8008"},
            "c": ["host=pg-c", "http://pg-c1:8008"],
        }
    )
    assert shards == (
        Shard("a", "host=pg-a"),
        Shard("b", "host=pg-b", ("http://pg-b1:8008", "http://pg-b2:8008")),
        Shard("c", "host=pg-c", ("http://pg-c1:8008",)),
    )
    assert parse_shards(json.dumps(THREE)) == parse_shards(THREE)  # the environment's form
    assert parse_shards(None) is None and parse_shards("") is None


@pytest.mark.parametrize(
    ("raw", "says"),
    [
        ({}, "non-empty mapping"),
        ("not json", "JSON object"),
        ({"": "host=x"}, "shard name ''"),
        ({"a b": "host=x"}, "shard name 'a b'"),
        ({"a": 5}, "shard 'a': must be a DSN"),
        ({"a": {"dsn": "host=x", "password": "s3cret"}}, "unknown keys ['password']"),
        ({"a": {"patroni_url": "http://x:8008"}}, "shard 'a': its DSN must be a non-empty str"),
        ({"a": {"dsn": "host=x", "patroni_url": "ftp://x"}}, "shard 'a': its patroni_url"),
    ],
)
def test_a_bad_shard_setting_says_which_shard_and_why(raw: Any, says: str) -> None:
    with pytest.raises(ValueError) as refused:
        parse_shards(raw)
    assert says in str(refused.value)


def test_a_malformed_dsn_is_refused_without_showing_it() -> None:
    with pytest.raises(ValueError) as refused:
        parse_shards({"a": "postgresql://u:p/w9x@h/db"})
    message = str(refused.value)
    assert message.startswith("shard 'a': its DSN is not valid") and "p/w9x" not in message


def test_a_bad_shard_setting_is_refused_at_load_naming_it_and_hiding_its_value() -> None:
    with pytest.raises(ConfigurationError) as refused:
        load_config({}, {"PGLOCK_SHARDS": '{"a": "postgresql://u:pw9x/7@h/db"}'})
    assert "PGLOCK_SHARDS=<hidden>" in str(refused.value)
    assert "pw9x" not in str(refused.value)


def test_names_spread_evenly_and_the_same_key_always_goes_to_the_same_shard() -> None:
    counts = Counter(rendezvous(key, ["a", "b", "c"]) for key in KEYS)
    assert set(counts) == {"a", "b", "c"}
    assert all(0.28 < count / len(KEYS) < 0.39 for count in counts.values()), counts
    # The order the shards are listed in changes nothing.
    assert all(rendezvous(k, ["c", "a", "b"]) == rendezvous(k, ["a", "b", "c"]) for k in KEYS)


def test_adding_a_shard_moves_only_the_names_it_now_ranks_first_for() -> None:
    before = {key: rendezvous(key, ["a", "b", "c"]) for key in KEYS}
    after = {key: rendezvous(key, ["a", "b", "c", "d"]) for key in KEYS}
    moved = [key for key in KEYS if before[key] != after[key]]
    assert all(after[key] == "d" for key in moved)
    assert 0.2 < len(moved) / len(KEYS) < 0.3, len(moved)


@given(st.integers(-(2**63), 2**63 - 1), st.sampled_from(["a", "b", "c", "d"]))
def test_removing_a_shard_moves_only_its_own_names(key: int, removed: str) -> None:
    names = ["a", "b", "c", "d"]
    before = rendezvous(key, names)
    after = rendezvous(key, [name for name in names if name != removed])
    assert after == before or before == removed


def sharded(**settings: Any) -> PglockConfig:
    return PglockConfig(shards=parse_shards(settings.pop("shards", THREE)), **settings)


def test_a_lock_gets_its_shards_dsn_and_patroni_urls_and_a_configuration_per_shard() -> None:
    config = sharded(
        shards={"a": "host=pg-a", "b": {"dsn": "host=pg-b", "patroni_url": "http://pg-b:8008"}},
        check_interval=1.0,
    )
    placed = {config.shard_of(key): config.for_key(key) for key in KEYS[:200]}
    assert set(placed) == {"a", "b"}
    assert placed["a"].dsn == "host=pg-a" and placed["a"].patroni_url is None
    assert placed["b"].dsn == "host=pg-b" and placed["b"].patroni_url == ("http://pg-b:8008",)
    assert all(shard.shards is None and shard.check_interval == 1.0 for shard in placed.values())
    assert config.for_key(KEYS[0]) is config.for_key(KEYS[0])  # one per shard: one source
    assert [name for name, _ in config.each_shard()] == ["a", "b"]


def test_without_shards_every_lock_is_on_the_one_default_shard() -> None:
    config = PglockConfig(dsn="host=pg")
    assert config.shard_of(KEYS[0]) == DEFAULT
    assert config.for_key(KEYS[0]) is config
    assert config.each_shard() == ((DEFAULT, config),)


def test_a_dsn_given_is_that_database_alone() -> None:
    narrowed = sharded().with_dsn("host=elsewhere")
    assert narrowed.shards is None and narrowed.for_key(KEYS[0]).dsn == "host=elsewhere"


@pytest.mark.parametrize(
    "other", [{"dsn": "host=x"}, {"patroni_url": ("http://x:8008",)}, {"database": "default"}]
)
def test_shards_are_refused_beside_a_setting_that_names_one_database(other: Any) -> None:
    with pytest.raises(ConfigurationError, match="pglock_shards and pglock_"):
        sharded(**other)


def test_a_shard_name_given_twice_is_refused() -> None:
    with pytest.raises(ConfigurationError, match="a given twice"):
        PglockConfig(shards=(Shard("a", "host=x"), Shard("a", "host=y")))


def placement(name: str) -> str | None:
    return "c" if name.startswith("legacy:") else None


def test_a_rule_places_its_names_first_and_leaves_the_rest_to_the_hash() -> None:
    config = sharded(shard_rule=placement)
    legacy = [f"legacy:{i}" for i in range(50)]
    assert {config.shard_of(lock_key(name), name) for name in legacy} == {"c"}
    others = [f"tenant:{i}" for i in range(300)]
    assert all(
        config.shard_of(lock_key(n), n) == rendezvous(lock_key(n), ["a", "b", "c"]) for n in others
    )


def test_a_rule_is_read_from_module_and_function_in_the_environment() -> None:
    config = load_config(
        {},
        {
            "PGLOCK_SHARDS": json.dumps(THREE),
            "PGLOCK_SHARD_RULE": "tests.unit.test_shards:placement",
        },
    )
    assert config.shard_of(lock_key("legacy:1"), "legacy:1") == "c"


def test_a_rule_naming_an_unknown_shard_or_a_bare_key_under_a_rule_is_refused() -> None:
    config = sharded(shard_rule=lambda name: "z")
    with pytest.raises(ConfigurationError, match="placed lock 'x' on shard 'z'"):
        config.shard_of(lock_key("x"), "x")
    with pytest.raises(LockNameError, match="with pglock_shard_rule, a lock is taken by its name"):
        sharded(shard_rule=placement).shard_of(42)


def test_a_rule_without_shards_is_refused() -> None:
    with pytest.raises(ConfigurationError, match="pglock_shard_rule is set without"):
        PglockConfig(dsn="host=x", shard_rule=placement)


def test_the_dsns_stay_out_of_the_configurations_repr() -> None:
    config = sharded(shards={"a": "host=pg-a password=s3cret"})
    assert "s3cret" not in repr(config) and "s3cret" not in repr(config.shards)


def _documented_rule(key: int, names: list[str]) -> str:
    """The placement rule as docs/shards.md states it, written out plainly."""

    def score(name: str) -> int:
        text = f"{name}\0{key}".encode()
        return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "big")

    return max(names, key=lambda name: (score(name), name))


@given(
    st.integers(min_value=-(2**63), max_value=2**63 - 1),
    st.lists(
        st.from_regex(r"[a-z0-9][a-z0-9_.-]{0,8}", fullmatch=True),
        min_size=1,
        max_size=6,
        unique=True,
    ),
)
def test_the_placement_rule_never_changes(key: int, names: list[str]) -> None:
    """Every deployment's names are placed by it: a faster rendezvous must place alike."""
    assert rendezvous(key, names) == _documented_rule(key, names)


def test_the_placement_of_known_keys_is_what_it_always_was() -> None:
    """Computed with the rule as it first shipped: any later code must place alike."""
    keys = (0, 1, -1, 2**62, 12345, -9876543210)
    assert [rendezvous(key, ["a", "b", "c"]) for key in keys] == ["a", "c", "c", "c", "a", "b"]
