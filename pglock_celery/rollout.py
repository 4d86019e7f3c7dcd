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
accepts the new map. Each step reads and writes the record under its write lock (one
step at a time), and the step that makes it records the lock sessions connected until
then with the map that ran before it. A shard without the record accepts every map, as
before any rollout: a transition worker refuses to run there (``pglock-celery shards
begin`` first).

A map is known by its shards' names, the parameters of each DSN that choose its
database (``service``, ``host``, ``port``, ``dbname``..., never a password) and its
rule's name (:class:`MapIdentity`): the transition's identity is the pair,
``previous>new``. Two DSNs of one database are one shard to the transition: its
sessions note which database each DSN reached (:func:`known_database`).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import hashlib
import json
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import psycopg

from . import sql
from .dsn import database_parameters, describe_target
from .exceptions import LockUnavailable, PglockError
from .shards import DEFAULT, Rule, Shard

__all__ = [
    "MapIdentity",
    "Rollout",
    "RolloutRefused",
    "enter",
    "known_database",
    "map_identity",
]

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
        sorted((shard.name, database_parameters(shard.dsn)) for shard in shards)
        if shards is not None
        else [(DEFAULT, database_parameters(dsn or ""))]
    )
    named = None if rule is None else f"{rule.__module__}:{rule.__qualname__}"
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


#: DSN -> the database it reached (database_of), as the lock sessions of a transition
#: last found it: whether a name's previous shard and its new one are one database.
_databases: dict[str, str] = {}


def known_database(dsn: str) -> str | None:
    """The database a transition's lock session on ``dsn`` last reached, if one opened."""
    return _databases.get(dsn)


def enter(
    conn: psycopg.Connection[Any],
    identity: MapIdentity,
    where: str,
    dsn: str,
    *,
    refusable: bool = True,
) -> None:
    """Record that this lock session came with ``identity`` and, if ``refusable``, check
    that its map is accepted here; LockUnavailable (saying why) if not. A transition's
    session also notes which database ``dsn`` reached (:func:`known_database`). Only
    where the record exists."""
    conn.execute(sql.ENTER_MAP, (identity.name,))
    if not (refusable or identity.transition):
        return
    # A statement of its own: its snapshot is taken after the record above committed,
    # so a finish that stopped accepting this map either is seen here or sees this.
    if identity.transition:
        row = conn.execute(sql.MAP_ACCEPTED_WHERE, (identity.name,)).fetchone()
        assert row is not None
        accepted, maps, database = row
        _databases[dsn] = str(database)
    else:
        row = conn.execute(sql.MAP_ACCEPTED, (identity.name,)).fetchone()
        assert row is not None
        accepted, maps = row
    if refusable and not accepted:
        raise LockUnavailable(
            f"the shard map {identity.name} of this worker is not accepted on {where} "
            f"(it accepts {maps or 'none'}): a change of pglock_shards is under way "
            "(pglock-celery shards status says which step)"
        )


def _labelled(shards: Sequence[tuple[str, str]]) -> list[tuple[str, str]]:
    """``shards`` with each shard name that is there more than once told apart by its
    database (``a [host:port/db]``), so what one step reads of each is never merged."""
    counts = collections.Counter(name for name, _ in shards)
    labelled = [
        (name if counts[name] == 1 else f"{name} [{describe_target(dsn)}]", dsn)
        for name, dsn in shards
    ]
    again = collections.Counter(label for label, _ in labelled)
    return [
        (label if again[label] == 1 else f"{label} #{i}", dsn)
        for i, (label, dsn) in enumerate(labelled, 1)
    ]


def _recorded(conn: psycopg.Connection[Any]) -> bool:
    row = conn.execute(sql.SHARD_RECORD_EXISTS).fetchone()
    return bool(row and row[0])


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

#: How long a step waits for another step of the shards to finish on a database.
STEP_LOCK_WAIT = "30s"


def database_of(conn: psycopg.Connection[Any]) -> str:
    """Which database ``conn`` is on (sql.DATABASE_OF): equal for two connections only
    when they reach one database."""
    row = conn.execute(sql.DATABASE_OF).fetchone()
    assert row is not None
    return str(row[0])


class Rollout:
    """The operator's side of a change of the shards, over every database of both maps.

    ``shards``: every shard database concerned, name and DSN (the union of the old and
    the new map; a shard moved to another database is there twice, each told apart by
    its database in what the steps say); ``identity``: the map of the configuration the
    operator runs it with; ``connect``: how to open an inspection session on a DSN.
    Each step refuses (RolloutRefused) a record that is not of this change, and never
    accepts a map while a session of one it excludes may still be connected. A step
    reads and writes the record of every database under that record's write lock, so
    two steps (two operators, a deploy script) run one after the other, each on what
    the other left.
    """

    def __init__(
        self,
        shards: Sequence[tuple[str, str]],
        identity: MapIdentity,
        connect: Connect,
    ) -> None:
        self.shards = _labelled(shards)
        self.identity = identity
        self.connect = connect

    def init(self) -> dict[str, list[Connected]]:
        """Accept this (steady) map alone on every shard, where no other is accepted:
        from now on a worker of another map is refused. The sessions of other maps
        connected meanwhile (let in before: stop those workers)."""
        assert not self.identity.transition
        steady = self.identity.name
        with self._step(before=steady) as databases:
            self._refuse_unless({steady}, "initialise it for", self._read(databases))
            self._write(databases, [steady])
        return self._recorded_apart_from({steady})

    def begin(self) -> dict[str, list[Connected]]:
        """Accept the old map and the transition on every shard; the new map is refused.
        Refused where a shard accepts a map of neither (nor the reverse change): no
        session of another map may then be connected. The sessions of other maps
        connected meanwhile."""
        old, transition = self._transition()
        if old == self.identity.steady:
            raise RolloutRefused(
                f"the old and the new map are one map ({old}): their shards have the same "
                "names and the same DSNs as written, so their workers cannot be told apart. "
                "A database changed behind an unchanged DSN (a service file, the "
                "environment) cannot be fenced: name it in the DSN (another service name)"
            )
        allowed = {old, transition, f"{self.identity.steady}>{old}"}
        with self._step(before=old) as databases:
            self._refuse_unless(allowed, "begin", self._read(databases))
            # Only the old map's and the transition's sessions may be connected: the old
            # map beside the new one's would let both hold a name (going back from a
            # change whose finish still waits for the old map's workers), and the two
            # transitions take their two locks in opposite orders. A session that
            # recorded no map may be of any.
            ahead = self._left(databases, {old, transition})
            if ahead:
                raise RolloutRefused(
                    f"cannot begin: {describe(ahead)}, beside which this change's old map "
                    "and transition may not run. If a change the other way is under way, "
                    "take it back with its own `begin`, or finish it and roll its workers "
                    "to its new map alone, first; nothing written"
                )
            self._write(databases, [old, transition])
        return self._recorded_apart_from(allowed)

    def finish(
        self, timeout: float, report: Callable[[str], None]
    ) -> tuple[bool, dict[str, list[Connected]]]:
        """Accept the transition alone, wait (up to ``timeout`` s) until no session of
        another map is connected on any shard, then accept the new map too: checked
        once more, and written, under the record's write lock, so a step run meanwhile
        (a ``begin`` that let the old map back) is seen, never overwritten.

        Returns whether it was finished already, and what is left (empty when the new
        map is accepted; else the old one stays refused with the new one, and finish
        may run again)."""
        _, transition = self._transition()
        final = {transition, self.identity.steady}
        if any(maps is None for maps in self.accepted().values()):
            raise RolloutRefused(
                "a shard keeps no record of the shard maps: run `pglock-celery shards "
                "begin` with this configuration first"
            )
        with self._step() as databases:
            accepted = self._read(databases)
            self._refuse_unless({*final, *self._old()}, "finish", accepted)
            if all(set(maps) == final for maps in accepted.values()):
                return True, {}
            self._write(databases, [transition])
        deadline = time.monotonic() + timeout
        while True:
            left = self.drain([transition], deadline - time.monotonic(), report)
            if left:
                return False, left
            with self._step() as databases:
                self._refuse_unless(final, "finish", self._read(databases), meanwhile=True)
                left = self._left(databases, {transition})
                if not left:
                    self._write(databases, sorted(final))
                    return False, {}
            if time.monotonic() >= deadline:
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

    @staticmethod
    def _refuse_unless(
        allowed: set[str],
        step: str,
        accepted: Mapping[str, Sequence[str] | None],
        *,
        meanwhile: bool = False,
    ) -> None:
        for shard, maps in accepted.items():
            foreign = sorted(set(maps or ()) - allowed)
            if not foreign:
                continue
            if meanwhile:
                raise RolloutRefused(
                    f"while finish waited, shard {shard} came to accept map "
                    f"{', '.join(foreign)} again (another step ran meanwhile, a `begin` "
                    "say, or this finish could not write there): nothing written; run "
                    "finish again"
                )
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

    @contextlib.contextmanager
    def _step(
        self, before: str | None = None
    ) -> Iterator[list[tuple[str, psycopg.Connection[Any]]]]:
        """Every database of the shards once (two DSNs of one database are one), each in
        a transaction that holds its record's write lock, taken in one order (the
        databases' own identities) by every step so none waits for another in a
        circle. The record is created where it is missing, its lock sessions connected
        until then recorded with the map ``before`` (the one that ran before any
        record); nothing is written unless the step ends without an error."""
        with contextlib.ExitStack() as stack:
            found: dict[str, tuple[str, psycopg.Connection[Any]]] = {}
            for shard, dsn in self.shards:
                conn = stack.enter_context(self.connect(dsn))
                self._sees_every_session(shard, conn)  # refused before anything is written
                where = database_of(conn)
                if where in found:
                    conn.close()  # a second DSN of a database already in the step
                else:
                    found[where] = (shard, conn)
            databases = [found[where] for where in sorted(found)]
            for shard, conn in databases:
                if _recorded(conn):
                    conn.execute(sql.PRUNE_SHARD_SESSIONS)
                stack.enter_context(conn.transaction())
                conn.execute(sql.SET_STEP_LOCK_WAIT, (STEP_LOCK_WAIT,))
                if not _recorded(conn):
                    for statement in sql.CREATE_SHARD_RECORD:
                        conn.execute(statement)
                    if before is not None:
                        conn.execute(sql.ADOPT_SESSIONS, (before,))
                    for statement in sql.SHARD_RECORD_SECURITY:
                        conn.execute(statement)
                try:
                    conn.execute(sql.LOCK_SHARD_MAPS)
                except psycopg.errors.LockNotAvailable:
                    raise RolloutRefused(
                        f"shard {shard}: its record of the shard maps stayed locked for "
                        f"{STEP_LOCK_WAIT}: another step of the shards runs there; nothing "
                        "written"
                    ) from None
            yield databases

    @staticmethod
    def _read(databases: list[tuple[str, psycopg.Connection[Any]]]) -> dict[str, list[str]]:
        return {
            shard: [r[0] for r in conn.execute(sql.ACCEPTED_MAPS).fetchall()]
            for shard, conn in databases
        }

    @staticmethod
    def _write(databases: list[tuple[str, psycopg.Connection[Any]]], maps: Iterable[str]) -> None:
        wanted = sorted(set(maps))
        for _, conn in databases:
            conn.execute(sql.ACCEPT_ONLY, (wanted,))
            for name in wanted:
                conn.execute(sql.ACCEPT_MAP, (name,))

    def _left(
        self, databases: list[tuple[str, psycopg.Connection[Any]]], keep: set[str]
    ) -> dict[str, list[Connected]]:
        left = {}
        for shard, conn in databases:
            others = [s for s in self._sessions(shard, conn) if s.map not in keep]
            if others:
                left[shard] = others
        return left

    def accept(self, maps: Iterable[str]) -> None:
        """On every shard, create the record if need be and accept exactly ``maps``."""
        with self._step() as databases:
            self._write(databases, maps)

    def accepted(self) -> dict[str, list[str] | None]:
        """Each shard's accepted maps (None where no record exists)."""
        found: dict[str, list[str] | None] = {}
        for shard, dsn in self.shards:
            with self.connect(dsn) as conn:
                if not _recorded(conn):
                    found[shard] = None
                    continue
                found[shard] = [r[0] for r in conn.execute(sql.ACCEPTED_MAPS).fetchall()]
        return found

    def connected(self) -> dict[str, list[Connected]]:
        """Each shard's live lock sessions with the map each recorded."""
        found: dict[str, list[Connected]] = {}
        for shard, dsn in self.shards:
            with self.connect(dsn) as conn:
                found[shard] = self._sessions(shard, conn)
        return found

    @staticmethod
    def _sees_every_session(shard: str, conn: psycopg.Connection[Any]) -> None:
        sees = conn.execute(sql.SEES_EVERY_SESSION).fetchone()
        if not (sees and sees[0]):
            raise RolloutRefused(
                f"on shard {shard} this role does not see other roles' sessions "
                "whole, so it cannot tell which map each lock session came with: "
                "run the step as a superuser or a member of pg_read_all_stats"
            )

    @classmethod
    def _sessions(cls, shard: str, conn: psycopg.Connection[Any]) -> list[Connected]:
        cls._sees_every_session(shard, conn)
        conn.execute(sql.FRESH_ACTIVITY)
        query = sql.CONNECTED_SESSIONS if _recorded(conn) else sql.UNRECORDED_SESSIONS
        return [Connected(*r) for r in conn.execute(query).fetchall()]

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
