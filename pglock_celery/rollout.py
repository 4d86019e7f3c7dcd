"""The fence of a change of the shards: old-map and new-map workers never hold at once.

A worker on the old map locks a moving name on its old shard, a worker on the new map
on its new one: the two share no lock. The transition (``pglock_shards_previous``)
takes both, so it excludes either; what keeps old-map and new-map workers from
running at once is this record on every shard's database:

- ``public.pglock_shard_maps``: the maps whose workers may lock there;
- ``public.pglock_shard_sessions``: which map each lock session came with (its pid and
  its backend's start, so a row of a session gone since is stale, never in the way).

Every lock session, once connected, records its map, and then (in a statement of its
own, so after the record is committed) reads whether its map is accepted: refused, it
is closed and the lock fails closed (LockUnavailable). The operator's ``finish`` first
accepts only the transition, then waits until no session of another map is connected
(each one accepted before is recorded before it read, so it is seen), and only then
accepts the new map. A shard without the record accepts every map, as before any
rollout: a transition worker refuses to run there (``pglock-celery shards begin``
first).

A map is known by its shards' names and databases (``host:port/dbname``, never a
password) and its rule's name (:class:`MapIdentity`): the transition's identity is
the pair, ``previous>new``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import psycopg

from . import sql
from .dsn import describe_target
from .exceptions import LockUnavailable, PglockError
from .shards import DEFAULT, Rule, Shard

__all__ = ["MapIdentity", "Rollout", "RolloutRefused", "enter", "map_identity"]

#: How often ``finish`` looks again for sessions of a map no longer accepted.
DRAIN_POLL = 0.5


@dataclasses.dataclass(frozen=True)
class MapIdentity:
    """A shard map's name as its lock sessions record it: the new map's digest, and
    during a transition the previous map's too."""

    steady: str
    previous: str | None = None

    @property
    def name(self) -> str:
        return self.steady if self.previous is None else f"{self.previous}>{self.steady}"

    @property
    def transition(self) -> bool:
        return self.previous is not None


def _digest(shards: Sequence[Shard] | None, dsn: str | None, rule: Rule | None) -> str:
    placed = (
        sorted((shard.name, describe_target(shard.dsn)) for shard in shards)
        if shards is not None
        else [(DEFAULT, describe_target(dsn or ""))]
    )
    named = None if rule is None else f"{rule.__module__}:{getattr(rule, '__qualname__', rule)}"
    text = json.dumps({"shards": placed, "rule": named}, sort_keys=True)
    return hashlib.blake2b(text.encode(), digest_size=6).hexdigest()


def map_identity(
    shards: Sequence[Shard] | None,
    previous: Sequence[Shard] | None,
    rule: Rule | None,
    dsn: str | None,
) -> MapIdentity:
    """The identity of the map ``shards`` (``dsn`` alone without them), and of the
    transition from ``previous`` when given."""
    steady = _digest(shards, dsn, rule)
    return MapIdentity(steady, None if previous is None else _digest(previous, None, rule))


def enter(
    conn: psycopg.Connection[Any], identity: MapIdentity, where: str, *, refusable: bool = True
) -> None:
    """Record that this lock session came with ``identity`` and, if ``refusable``, check
    that its map is accepted here; LockUnavailable (saying why) if not. Only where the
    record exists."""
    conn.execute(sql.ENTER_MAP, (identity.name,))
    if not refusable:
        return
    # A statement of its own: its snapshot is taken after the record above committed,
    # so a finish that stopped accepting this map either is seen here or sees this.
    row = conn.execute(sql.MAP_ACCEPTED, (identity.name,)).fetchone()
    assert row is not None
    accepted, maps = row
    if not accepted:
        raise LockUnavailable(
            f"the shard map {identity.name} of this worker is not accepted on {where} "
            f"(it accepts {maps or 'none'}): a change of pglock_shards is under way "
            "(pglock-celery shards status says which step)"
        )


class RolloutRefused(PglockError):
    """A step of a change of the shards does not fit the shards' record: nothing written."""


@dataclasses.dataclass(frozen=True)
class Connected:
    """A lock session connected to a shard's database, as ``finish`` and ``status`` see it."""

    map: str  # '' for a session that recorded none (connected before the record existed)
    pid: int
    application_name: str
    client: str | None


Connect = Callable[[str], psycopg.Connection[Any]]


class Rollout:
    """The operator's side of a change of the shards, over every database of both maps.

    ``shards``: every shard database concerned, name and DSN (the union of the old and
    the new map); ``identity``: the map of the configuration the operator runs it
    with; ``prefix``: the lock sessions' application_name prefix (sessions connected
    before the record existed are known by it); ``connect``: how to open an
    inspection session on a DSN. Each step refuses (RolloutRefused) a record that is
    not of this change, and never accepts a map while a session of one it excludes may
    still be connected.
    """

    def __init__(
        self,
        shards: Sequence[tuple[str, str]],
        identity: MapIdentity,
        prefix: str,
        connect: Connect,
    ) -> None:
        self.shards = shards
        self.identity = identity
        self.pattern = f"^{re.escape(prefix)}(-[^|]*)?[|]"
        self.connect = connect

    def init(self) -> dict[str, list[Connected]]:
        """Accept this (steady) map alone on every shard, where no other is accepted:
        from now on a worker of another map is refused. The sessions of other maps
        connected meanwhile (let in before: stop those workers)."""
        assert not self.identity.transition
        steady = self.identity.name
        self._refuse_unless({steady}, "initialise it for")
        self.accept([steady])
        return self._recorded_apart_from({steady})

    def begin(self) -> dict[str, list[Connected]]:
        """Accept the old map and the transition on every shard; the new map is refused.
        Refused where a shard accepts a map of neither (nor the reverse change): no
        session of another map may then be connected. The sessions of other maps
        connected meanwhile."""
        old, transition = self._transition()
        allowed = {old, transition, f"{self.identity.steady}>{old}"}
        self._refuse_unless(allowed, "begin")
        self.accept([old, transition])
        return self._recorded_apart_from(allowed)

    def finish(
        self, timeout: float, report: Callable[[str], None]
    ) -> tuple[bool, dict[str, list[Connected]]]:
        """Accept the transition alone, wait (up to ``timeout`` s) until no session of
        another map is connected on any shard, then accept the new map too.

        Returns whether it was finished already, and what is left (empty when the new
        map is accepted; else the old one stays refused with the new one, and finish
        may run again)."""
        _, transition = self._transition()
        final = {transition, self.identity.steady}
        accepted = self.accepted()
        if any(maps is None for maps in accepted.values()):
            raise RolloutRefused(
                "a shard keeps no record of the shard maps: run `pglock-celery shards "
                "begin` with this configuration first"
            )
        self._refuse_unless({*final, *self._old()}, "finish", accepted)
        if all(set(maps or ()) == final for maps in accepted.values()):
            return True, {}
        self.accept([transition])
        left = self.drain([transition], timeout, report)
        if not left:
            self.accept(sorted(final))
        return False, left

    def _transition(self) -> tuple[str, str]:
        if self.identity.previous is None:
            raise RolloutRefused(
                "this needs the configuration of the change: pglock_shards the new map and "
                "pglock_shards_previous the old one"
            )
        return self.identity.previous, self.identity.name

    def _old(self) -> set[str]:
        return set() if self.identity.previous is None else {self.identity.previous}

    def _refuse_unless(
        self,
        allowed: set[str],
        step: str,
        accepted: dict[str, list[str] | None] | None = None,
    ) -> None:
        for shard, maps in (accepted or self.accepted()).items():
            foreign = sorted(set(maps or ()) - allowed)
            if foreign:
                raise RolloutRefused(
                    f"shard {shard} accepts map {', '.join(foreign)}, of another change of "
                    f"the shards than this configuration's: cannot {step} this one there "
                    "(pglock-celery shards status)"
                )

    def _recorded_apart_from(self, maps: set[str]) -> dict[str, list[Connected]]:
        return {
            shard: [s for s in sessions if s.map and s.map not in maps]
            for shard, sessions in self.connected().items()
            if any(s.map and s.map not in maps for s in sessions)
        }

    def accept(self, maps: Iterable[str]) -> None:
        """On every shard, create the record if need be and accept exactly ``maps``."""
        wanted = sorted(set(maps))
        for _, dsn in self.shards:
            with self.connect(dsn) as conn, conn.transaction():
                for statement in sql.CREATE_SHARD_RECORD:
                    conn.execute(statement)
                conn.execute(sql.ACCEPT_ONLY, (wanted,))
                for name in wanted:
                    conn.execute(sql.ACCEPT_MAP, (name,))

    def accepted(self) -> dict[str, list[str] | None]:
        """Each shard's accepted maps (None where no record exists)."""
        found: dict[str, list[str] | None] = {}
        for shard, dsn in self.shards:
            with self.connect(dsn) as conn:
                row = conn.execute(sql.SHARD_RECORD_EXISTS).fetchone()
                if row is None or not row[0]:
                    found[shard] = None
                    continue
                found[shard] = [r[0] for r in conn.execute(sql.ACCEPTED_MAPS).fetchall()]
        return found

    def connected(self) -> dict[str, list[Connected]]:
        """Each shard's live lock sessions with the map each recorded."""
        found: dict[str, list[Connected]] = {}
        for shard, dsn in self.shards:
            with self.connect(dsn) as conn:
                sees = conn.execute(sql.SEES_EVERY_SESSION).fetchone()
                if not (sees and sees[0]):
                    raise RolloutRefused(
                        f"on shard {shard} this role does not see other roles' sessions "
                        "whole, so it cannot tell which map each lock session came with: "
                        "run the step as a superuser or a member of pg_read_all_stats"
                    )
                row = conn.execute(sql.SHARD_RECORD_EXISTS).fetchone()
                query = sql.CONNECTED_SESSIONS if row and row[0] else sql.UNRECORDED_SESSIONS
                rows = conn.execute(query, (self.pattern,)).fetchall()
                found[shard] = [Connected(*r) for r in rows]
        return found

    def drain(
        self, keep: Iterable[str], timeout: float, report: Callable[[str], None]
    ) -> dict[str, list[Connected]]:
        """Wait until no shard has a live lock session of a map other than ``keep``, at
        most ``timeout`` seconds; what is left (empty when drained)."""
        kept = set(keep)
        deadline = time.monotonic() + timeout
        said = None
        while True:
            left = {
                shard: [s for s in sessions if s.map not in kept]
                for shard, sessions in self.connected().items()
                if any(s.map not in kept for s in sessions)
            }
            if not left or time.monotonic() >= deadline:
                return left
            summary = describe(left)
            if summary != said:
                report(f"waiting for {summary}")
                said = summary
            time.sleep(DRAIN_POLL)


def describe(sessions: dict[str, list[Connected]]) -> str:
    """``3 session(s) of map X on shard a (pids 1, 2, 3)``, one clause per map and shard."""
    parts = []
    for shard, found in sessions.items():
        by_map: dict[str, list[int]] = {}
        for session in found:
            by_map.setdefault(session.map or "(none recorded)", []).append(session.pid)
        for name, pids in sorted(by_map.items()):
            shown = ", ".join(str(pid) for pid in pids[:5]) + (", ..." if len(pids) > 5 else "")
            parts.append(f"{len(pids)} session(s) of map {name} on shard {shard} (pids {shown})")
    return "; ".join(parts)
