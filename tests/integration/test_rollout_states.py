"""The fence of a change of the shards, explored over its states (rollout.py).

Holders on the old map, the transition and the new map of a moving name come and go,
their idle sessions are closed or kept, and the operator's steps (init, begin,
finish) run in any order, against three real databases: no two holders of the name
are ever granted at once, a step that does not fit the record writes nothing, and
finish accepts the new map exactly when no session of the old one is left.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import psycopg
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pglock_celery import LockUnavailable
from pglock_celery.config import PglockConfig
from pglock_celery.keys import lock_key
from pglock_celery.lock import AdvisoryLock
from pglock_celery.rollout import Rollout, RolloutRefused
from pglock_celery.shards import parse_shards
from pglock_celery.sources import registry
from pglock_celery.sources.dedicated import DedicatedSource
from tests.support.services import own_database

KINDS = ("old", "transition", "new")


def connect(dsn: str) -> psycopg.Connection:
    return psycopg.connect(dsn, autocommit=True)


@pytest.fixture(scope="module")
def three(pg_dsn: str) -> Iterator[dict[str, str]]:
    with own_database(pg_dsn) as a, own_database(pg_dsn) as b, own_database(pg_dsn) as c:
        yield {"a": a, "b": b, "c": c}


def configs(three: dict[str, str]) -> dict[str, PglockConfig]:
    """One configuration per kind of worker, each with a prefix of its own: one process,
    yet each kind's sessions its own, as in separate workers."""
    two = parse_shards({"a": three["a"], "b": three["b"]})
    every = parse_shards(three)
    return {
        "old": PglockConfig(shards=two, application_name="pglock-old"),
        "transition": PglockConfig(shards=every, shards_previous=two, application_name="pglock-tr"),
        "new": PglockConfig(shards=every, application_name="pglock-new"),
    }


def moving_name(config: PglockConfig) -> str:
    for _ in range(1000):
        name = f"rollout-states:{uuid.uuid4().hex[:8]}"
        if config.previous_for_key(lock_key(name), name) is not None:
            return name
    raise AssertionError("no name moves")


def test_the_fence_holds_in_every_state_it_is_driven_through(three: dict[str, str]) -> None:
    kinds = configs(three)
    name = moving_name(kinds["transition"])

    class Fence(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            for dsn in three.values():
                with connect(dsn) as conn:
                    conn.execute("DROP TABLE IF EXISTS pglock_shard_maps, pglock_shard_sessions")
            shards = list(three.items())
            self.operator = {
                kind: Rollout(shards, config.map_identity, connect)  # type: ignore[arg-type]
                for kind, config in kinds.items()
            }
            self.held: list[tuple[str, AdvisoryLock]] = []
            self.accepted: set[str] | None = None  # None: no record
            self.ids = {kind: c.map_identity.name for kind, c in kinds.items()}  # type: ignore[union-attr]

        def sessions_of(self, kind: str) -> int:
            """Sessions of ``kind`` this process has open (held or idle)."""
            prefix = kinds[kind].application_name
            idle = sum(
                s.idle_count()
                for s in registry.sources()
                if isinstance(s, DedicatedSource) and s.config.application_name == prefix
            )
            previous = sum(
                2 if lock._previous is not None else 1 for k, lock in self.held if k == kind
            )
            return idle + previous

        @rule(kind=st.sampled_from(KINDS))
        def hold(self, kind: str) -> None:
            if kind == "new" and self.accepted is None:
                # Without a record nothing fences a new-map worker: docs/shards.md has
                # init or begin run before one starts.
                return
            lock = AdvisoryLock(name, config=kinds[kind])
            try:
                granted = lock.acquire()
            except LockUnavailable:
                lock.release()
                # Refused for its map: only where a record does not accept it.
                assert (kind == "transition" and self.accepted is None) or (
                    self.accepted is not None and self.ids[kind] not in self.accepted
                )
                return
            if granted:
                self.held.append((kind, lock))
            else:
                lock.release()

        @precondition(lambda self: self.held)
        @rule(data=st.data())
        def release(self, data: st.DataObject) -> None:
            _, lock = self.held.pop(data.draw(st.integers(0, len(self.held) - 1)))
            lock.release()

        @rule(kind=st.sampled_from(KINDS))
        def close_idle(self, kind: str) -> None:
            for source in registry.sources():
                if source.config.application_name == kinds[kind].application_name:
                    source.close()

        @rule()
        def init(self) -> None:
            try:
                self.operator["old"].init()
            except RolloutRefused:
                assert self.accepted is not None and self.accepted - {self.ids["old"]}
                return
            self.accepted = {self.ids["old"]}

        @rule()
        def begin(self) -> None:
            try:
                self.operator["transition"].begin()
            except RolloutRefused:
                assert self.accepted is not None and self.ids["new"] in self.accepted
                return
            self.accepted = {self.ids["old"], self.ids["transition"]}

        @rule()
        def finish(self) -> None:
            try:
                already, left = self.operator["transition"].finish(0, lambda line: None)
            except RolloutRefused:
                assert self.accepted is None
                return
            assert already == (self.accepted == {self.ids["transition"], self.ids["new"]})
            old_left = self.sessions_of("old") > 0
            assert bool(left) == (old_left and not already), (left, old_left)
            self.accepted = (
                {self.ids["transition"]} if left else {self.ids["transition"], self.ids["new"]}
            )

        @invariant()
        def one_holder_at_most(self) -> None:
            assert len(self.held) <= 1, [kind for kind, _ in self.held]

        @invariant()
        def the_record_is_as_the_steps_left_it(self) -> None:
            found = self.operator["old"].accepted()
            for maps in found.values():
                assert (None if maps is None else set(maps)) == self.accepted

        def teardown(self) -> None:
            for _, lock in self.held:
                lock.release()
            registry.close()

    Fence.TestCase.settings = settings(
        max_examples=25,
        stateful_step_count=18,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
    Fence.TestCase().runTest()
