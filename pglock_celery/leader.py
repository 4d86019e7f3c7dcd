"""Who leads a cluster: the one question the lock path asks of a leader election.

A session advisory lock lives on one Postgres server. After a failover the new primary
knows nothing of it, and an old primary that still runs keeps serving its sessions. With
a leader source configured, a lock is valid only while the source has recently confirmed
that its session's server leads, for long enough that no other server can be promoted
meanwhile (G12). The lock path (sources/, session.py, task.py) knows only this module:

- :func:`leader_source` builds a configuration's source, or None (no fence);
- ``identify(conn)``: which server a new session is on (a ServerIdentity), asked once as
  the session opens, before it takes any lock;
- ``confirm(server, fresh_for=...)``: is it the leader, and until when to trust that (a
  Confirmation: a monotonic deadline, and a Standing that the loss is made from, never
  its text);
- ``check_interval(wanted)``: how often a lock must be checked so that each check finds
  a confirmation that outlasts the next; ``longest_ask``: the most one ``confirm`` takes;
- ``problem(wanted)``: at worker start, why no lock could be kept at all, or None.

Patroni is the one implementation (patroni.py, chosen by ``pglock_patroni_url``).
Another source (a Kubernetes lease, pg_auto_failover's monitor, a managed service's
endpoint) plugs in by implementing :class:`LeaderSource` (with a ``parse_setting`` for
its setting's value, and a ``from_setting(value, config)`` that builds it, reading any
setting of its own, such as Patroni's TLS files, from the configuration) and a row in
:data:`SOURCES`; it needs a safety argument of the
kind patroni.py gives: while ``confirm`` returns a confirmation valid at some moment, no
other server can have been promoted by then.
"""

from __future__ import annotations

import dataclasses
import datetime
import enum
import importlib
import time
from typing import Any, Protocol

import psycopg

from . import sql

__all__ = [
    "Confirmation",
    "LeaderSource",
    "ServerIdentity",
    "Standing",
    "leader_source",
    "parse_setting",
    "server_identity",
]


@dataclasses.dataclass(frozen=True)
class ServerIdentity:
    """The Postgres server a lock session is on.

    ``started_at`` (``pg_postmaster_start_time()``) is what tells servers apart: it
    differs between servers, and a restarted server gets a new one, so a session of a
    former postmaster never matches it. ``host`` and ``port`` (as libpq reports them)
    only name it in messages.
    """

    host: str
    port: int
    started_at: datetime.datetime


def server_identity(conn: psycopg.Connection[Any]) -> ServerIdentity:
    """Ask ``conn``'s server who it is (one statement: sql.SERVER_IDENTITY).

    Run it when the session is opened, outside any transaction of the caller's.
    """
    row = conn.execute(sql.SERVER_IDENTITY).fetchone()
    if row is None or not isinstance(row[0], datetime.datetime):
        raise psycopg.DataError("pg_postmaster_start_time() returned no timestamp")
    return ServerIdentity(conn.info.host, int(conn.info.port), row[0])


class Standing(enum.Enum):
    """What a leader source's answer says of a server (what a loss is made from)."""

    LEADER = "leader"
    #: Another server leads, or this one is not a running primary.
    NOT_LEADER = "not the leader"
    #: No answer that settles it (no reply, an expired view, a cluster in doubt).
    CANNOT_TELL = "cannot tell"
    #: The one asked runs another server: ask the one that runs it.
    ELSEWHERE = "another server"


@dataclasses.dataclass(frozen=True)
class Confirmation:
    """A source's answer: leader until ``until`` (time.monotonic()), or not and why.

    ``standing`` is what the lock acts on; ``reason`` is for people (it names the
    source's member by host and port, never a URL's credentials).
    """

    leader: bool
    until: float
    reason: str = ""
    member: str | None = None
    standing: Standing = Standing.CANNOT_TELL

    def valid(self, now: float | None = None, *, for_at_least: float = 0.0) -> bool:
        """True while it confirms leadership for ``for_at_least`` more seconds."""
        now = time.monotonic() if now is None else now
        return self.leader and now + for_at_least < self.until


class LeaderSource(Protocol):
    """What the lock path asks of a leader election (see the module docstring).

    One per configuration, shared by its threads; a forked child calls
    ``after_fork_in_child`` before using it.
    """

    #: Names the source in messages ("the Patroni cluster").
    name: str

    @property
    def longest_ask(self) -> float:
        """The most one ``confirm`` can take, in seconds."""
        ...

    def identify(self, conn: psycopg.Connection[Any]) -> ServerIdentity:
        """Which server ``conn`` is on (one statement, at the session's opening)."""
        ...

    def confirm(self, server: ServerIdentity, *, fresh_for: float = 0.0) -> Confirmation:
        """Is ``server`` the leader, and until when to trust that; a cached answer is
        reused while it stays valid for ``fresh_for`` more seconds."""
        ...

    def check_interval(self, wanted: float) -> float:
        """The check interval of a lock under this source: ``wanted``, or less."""
        ...

    def problem(self, wanted: float) -> str | None:
        """Why no lock can be kept under this source with check interval ``wanted``
        (a message with the fix, not naming the setting: the caller names it as the
        project wrote it), or None; asked at worker start."""
        ...

    def after_fork_in_child(self) -> None:
        """Made usable in a forked child (its locks and threads are the parent's)."""
        ...


#: The leader sources, each as (the setting that configures it, its module, its class);
#: the class is built from the setting's parsed value, and parses it with its
#: ``parse_setting``. Loaded only when configured.
SOURCES = (("patroni_url", "pglock_celery.patroni", "LeaderFence"),)


def _implementation(setting: str) -> Any:
    for name, module, attribute in SOURCES:
        if name == setting:
            return getattr(importlib.import_module(module), attribute)
    raise LookupError(f"no leader source is configured by {setting}")


def parse_setting(setting: str, raw: Any) -> tuple[str, ...]:
    """The value of a leader source's ``setting`` (``patroni_url``), parsed; ValueError
    saying what is wrong, never quoting the value."""
    parsed: tuple[str, ...] = _implementation(setting).parse_setting(raw)
    return parsed


class Settings(Protocol):
    """What leader_source reads of a configuration (config.PglockConfig)."""

    @property
    def patroni_url(self) -> tuple[str, ...] | None: ...

    @property
    def patroni_cafile(self) -> str | None: ...

    @property
    def patroni_certfile(self) -> str | None: ...

    @property
    def patroni_keyfile(self) -> str | None: ...


def leader_setting(config: Settings) -> str | None:
    """The setting (``patroni_url``) that gives ``config`` its leader source, if any."""
    for setting, _, _ in SOURCES:
        if getattr(config, setting):
            return setting
    return None


def leader_source(config: Settings) -> LeaderSource | None:
    """The leader source ``config`` names, or None when its locks are not fenced."""
    for setting, _, _ in SOURCES:
        value = getattr(config, setting)
        if value:
            source: LeaderSource = _implementation(setting).from_setting(value, config)
            return source
    return None
