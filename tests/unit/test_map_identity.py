"""A shard map's identity (rollout.py): what the fence of a change of the shards tells
maps apart by, and what it must not depend on."""

from __future__ import annotations

import functools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pglock_celery.config import PglockConfig
from pglock_celery.exceptions import ConfigurationError
from pglock_celery.rollout import Rollout, RolloutRefused
from pglock_celery.shards import parse_shards

NAMES = st.lists(st.sampled_from("abcdefg"), min_size=1, max_size=5, unique=True)


def shards(names: list[str], password: str = "") -> dict[str, str]:
    secret = f" password={password}" if password else ""
    return {name: f"host=db-{name} dbname=app{secret}" for name in names}


def identity(names: list[str], **settings: object) -> str:
    found = PglockConfig(shards=parse_shards(shards(names)), **settings).map_identity  # type: ignore[arg-type]
    assert found is not None
    return found.name


@given(NAMES, st.randoms())
def test_the_order_the_shards_are_listed_in_and_their_passwords_do_not_count(
    names: list[str], rng: object
) -> None:
    shuffled = list(names)
    rng.shuffle(shuffled)  # type: ignore[attr-defined]
    other = PglockConfig(shards=parse_shards(shards(shuffled, password="s3cret")))
    assert other.map_identity is not None
    assert other.map_identity.name == identity(names)
    assert "s3cret" not in other.map_identity.name


@given(NAMES, NAMES)
def test_maps_of_other_shards_have_other_identities(first: list[str], second: list[str]) -> None:
    assert (identity(first) == identity(second)) == (set(first) == set(second))


def test_a_shard_moved_to_another_database_under_its_name_is_another_map() -> None:
    moved = {**shards(["a", "b"]), "b": "host=db-b2 dbname=app"}
    config = PglockConfig(shards=parse_shards(moved))
    assert config.map_identity is not None
    assert config.map_identity.name != identity(["a", "b"])


def rule(name: str) -> str | None:
    return None


def test_a_rule_is_part_of_the_map() -> None:
    assert identity(["a", "b"], shard_rule=rule) != identity(["a", "b"])


def test_the_transition_is_known_by_both_maps_and_each_shard_keeps_it() -> None:
    config = PglockConfig(
        shards=parse_shards(shards(["a", "b", "c"])),
        shards_previous=parse_shards(shards(["a", "b"])),
    )
    found = config.map_identity
    assert found is not None and found.transition
    assert found.name == f"{identity(['a', 'b'])}>{identity(['a', 'b', 'c'])}"
    # Each shard's configuration, the previous map's shard and a DSN given: the whole map's.
    assert config.for_shard("c").map_identity == found
    previous = config.previous_for_key(0, "x") or config.for_shard("a")
    assert previous.map_identity == found
    assert config.with_dsn("host=elsewhere dbname=x").map_identity == found


def test_one_database_alone_is_a_map_of_one_shard() -> None:
    alone = PglockConfig(dsn="host=db-a dbname=app").map_identity
    assert alone is not None and not alone.transition
    assert alone != PglockConfig(dsn="host=db-b dbname=app").map_identity


@given(
    st.sampled_from(["service", "host", "hostaddr", "port", "dbname", "user"]),
    st.sampled_from(["one", "two"]),
)
def test_every_parameter_that_chooses_the_database_is_part_of_the_map(
    parameter: str, value: str
) -> None:
    written = {"service": "svc", "host": "db", "hostaddr": "10.0.0.1", "port": "5432"}
    written |= {"dbname": "app", "user": "worker"}
    values = {"hostaddr": "10.0.0.2", "port": "5433"}
    changed = {**written, parameter: values.get(parameter, value)}

    def one(params: dict[str, str]) -> str:
        dsn = " ".join(f"{k}={v}" for k, v in params.items())
        found = PglockConfig(shards=parse_shards({"a": dsn})).map_identity
        assert found is not None
        return found.name

    assert one(changed) != one(written)
    # What only tunes the connection is not: a timeout, the password.
    assert one({**written, "connect_timeout": "9", "password": "pw"}) == one(written)


def test_begin_refuses_a_change_that_leaves_the_map_as_written() -> None:
    """A service file edited behind an unchanged DSN: nothing can tell its workers apart."""
    same = {"a": "service=app"}
    config = PglockConfig(shards=parse_shards(same), shards_previous=parse_shards(same))
    assert config.map_identity is not None

    def never(dsn: str) -> object:
        raise AssertionError(f"connected to {dsn}: the refusal must come first")

    rollout = Rollout([("a", "service=app")], config.map_identity, never)  # type: ignore[arg-type]
    with pytest.raises(RolloutRefused, match="one map"):
        rollout.begin()


def test_a_rule_without_a_name_is_refused_as_the_configuration_is_made() -> None:
    """A functools.partial's text names its memory address: every process would compute
    another map, and be refused once the record exists."""
    placed = functools.partial(lambda name, to: to, to="a")
    with pytest.raises(ConfigurationError, match=r"pglock_shard_rule=.*has no name"):
        PglockConfig(shards=parse_shards(shards(["a", "b"])), shard_rule=placed)  # type: ignore[arg-type]
