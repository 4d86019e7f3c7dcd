"""pglock_* settings: from app.conf, then the environment, then defaults.

Each setting is looked up as the lowercase ``pglock_*`` key in ``app.conf``
(with the app's namespace, if any: ``CELERY_PGLOCK_*`` under
``namespace="CELERY"``), then as the uppercase ``PGLOCK_*`` environment
variable, then its default. A value that does not parse is an error, never a
silent fallback to the default: ConfigurationError names every bad key as
written and the values it takes (a worker refuses to start with one, see
task.py). The absence of ``pglock_dsn`` is an error at the first lock.

Every error names a setting the way the project wrote it: the key its value came
from (``CELERY_PGLOCK_DATABASE``, ``PROJ_PGLOCK_DSN``, a plain ``pglock_dsn``) or
its variable (``PGLOCK_DSN``); an unset one the way the app would read it
(namespaced when the app has a namespace). load_config records the names
(PglockConfig.named), so a check of two settings together names both so too.

The parsed settings are cached on the app, keyed by the raw values they came
from, so a change (``app.conf.pglock_dsn = ...`` in a test fixture, Django's
``override_settings``, a changed ``PGLOCK_*`` variable) counts from the next
call, and an unchanged configuration costs a few dict lookups per call.

Importing this module also makes Celery mask ``pglock_dsn`` wherever it masks
secret settings (``celery report``, ``celery inspect conf``).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import InitVar, dataclass
from datetime import datetime, timedelta, timezone
from types import MappingProxyType
from typing import Any

import celery.app.utils
import psycopg
from celery import Celery
from celery.utils.collections import DictAttribute
from psycopg.conninfo import conninfo_to_dict

from .dsn import dsn_problem
from .exceptions import ConfigurationError, LockNameError
from .leader import parse_setting as parse_leader_setting
from .rollout import MapIdentity, map_identity
from .shards import (
    DEFAULT,
    PREVIOUS_MARK,
    Rule,
    Shard,
    parse_rule,
    parse_shards,
    rendezvous,
)
from .tls import TLS_SETTINGS, readable_file, tls_context

_CACHE_ATTRIBUTE = "_pglock_config"


#: The most libpq and Postgres take for a parameter they read as a C int.
_INT_MAX = 2**31 - 1

_FINITE = "must be a finite number of seconds"


def _positive_float(raw: Any) -> float:
    """A finite number of seconds above 0, from a number or its text."""
    if isinstance(raw, bool):
        raise ValueError(f"must be a number of seconds, not {raw!r}")
    try:
        value = float(raw)
    except OverflowError:  # an int beyond any float
        raise ValueError(_FINITE) from None
    if not math.isfinite(value):
        raise ValueError(_FINITE)
    if not value > 0:
        raise ValueError("must be greater than 0")
    return value


def _connect_timeout(raw: Any) -> float:
    value = _positive_float(raw)
    if math.ceil(value) > _INT_MAX:
        raise ValueError(f"must be at most {_INT_MAX}: libpq takes it as a C int of seconds")
    return value


def _milliseconds(zero: str) -> Callable[[Any], float]:
    """A parser of seconds that libpq or Postgres take in whole milliseconds, as a C int.

    ``zero`` says what 0 ms would mean: a value below 1 ms is refused rather than
    sent as that.
    """

    def parse(raw: Any) -> float:
        value = _positive_float(raw)
        if value * 1000 < 1:
            raise ValueError(
                f"must be at least 0.001 (1 ms): it is sent in whole milliseconds, and 0 {zero}"
            )
        if value * 1000 > _INT_MAX:
            raise ValueError(
                f"must be at most {_INT_MAX / 1000} (2**31 - 1 ms): libpq and Postgres take it "
                "as a C int of milliseconds"
            )
        return value

    return parse


def _check_interval(raw: Any) -> float:
    value = _positive_float(raw)
    if math.isinf(1.25 * value):
        raise ValueError(
            "must be small enough that 1.25 times it (the bound within which a loss is "
            "noticed) is finite"
        )
    return value


def retry_countdown(raw: Any) -> float:
    """A retry countdown in seconds: finite, above 0, and one Celery can date (ValueError)."""
    value = _positive_float(raw)
    # Celery dates a retry at now plus the countdown; a day more covers any time zone.
    try:
        datetime.now(timezone.utc) + timedelta(days=1, seconds=value)
    except OverflowError:
        raise ValueError(
            "must be short enough that Celery's eta (now plus it) falls before the year 10000"
        ) from None
    return value


def _integer(raw: Any, why: str) -> int:
    """``raw`` as an int, exactly: an int, a whole float or the text of an int."""
    if isinstance(raw, bool):
        raise ValueError(why)
    try:
        value = int(raw)
    except (TypeError, ValueError, OverflowError):  # "1e400", "inf", NaN, infinity
        raise ValueError(why) from None
    if not isinstance(raw, str) and value != raw:  # 2.5 is not truncated to 2
        raise ValueError(why)
    return value


def _positive_int(raw: Any) -> int:
    why = "must be a whole number greater than 0"
    value = _integer(raw, why)
    if value <= 0:
        raise ValueError(why)
    return value


def _keepalive(option: str, most: int) -> Callable[[Any], int]:
    """A parser of a TCP keepalive setting, which Linux refuses above ``most``."""

    def parse(raw: Any) -> int:
        value = _positive_int(raw)
        if value > most:
            raise ValueError(f"must be at most {most}, Linux's limit for {option}")
        return value

    return parse


def _boolean(raw: Any) -> bool:
    if isinstance(raw, bool):
        return raw
    text = str(raw).strip().lower()
    if text in {"1", "true", "yes", "on"}:
        return True
    if text in {"0", "false", "no", "off"}:
        return False
    raise ValueError("must be true or false")


def _application_name(raw: Any) -> str:
    text = str(raw)
    if not text or not text.isascii() or "|" in text or len(text) > 16:
        raise ValueError("must be 1 to 16 ASCII characters without '|'")
    return text


#: The values of pglock_on_lost.
ON_LOST_REACTIONS = ("interrupt", "raise", "terminate")


def _reaction(raw: Any) -> str:
    text = str(raw).strip().lower()
    if text not in ON_LOST_REACTIONS:
        raise ValueError("must be 'interrupt', 'raise' or 'terminate'")
    return text


def _strategy(raw: Any) -> str:
    text = str(raw).strip().lower()
    if text not in ("connect", "reuse", "shared"):
        raise ValueError("must be 'connect', 'reuse' or 'shared'")
    return text


def _pooler(raw: Any) -> str:
    text = str(raw).strip().lower()
    if text not in ("none", "session"):
        raise ValueError("must be 'none' or 'session'")
    return text


def _whole(raw: Any) -> int:
    why = "must be a whole number, 0 or more"
    value = _integer(raw, why)
    if value < 0:
        raise ValueError(why)
    return value


def _patroni_url(raw: Any) -> tuple[str, ...] | None:
    if raw in (None, ""):
        return None
    return parse_leader_setting("patroni_url", raw)


def _dsn(raw: Any) -> str | None:
    if raw in (None, ""):
        return None
    if not isinstance(raw, str):
        raise ValueError("must be a libpq connection string (a str)")
    return raw


def _database(raw: Any) -> str | None:
    """A Django database alias (None: no pglock_database)."""
    if raw is None:
        return None
    if not isinstance(raw, str) or not raw.strip():
        raise ValueError("must be the alias of a Django database (a non-empty str)")
    return raw


@dataclass(frozen=True)
class PglockConfig:
    """The pglock settings of one Celery app (see the README for each)."""

    #: libpq connection string of the lock database (URI or key=value); kept
    #: out of repr() because it may hold a password.
    dsn: str | None = dataclasses.field(default=None, repr=False)
    #: Seconds to wait for a lock session's connection before failing closed.
    connect_timeout: float = 5.0
    #: First field of the lock session's application_name.
    application_name: str = "pglock"
    #: Client TCP keepalives: idle seconds, probe interval, probe count.
    keepalives_idle: int = 2
    keepalives_interval: int = 1
    keepalives_count: int = 3
    #: Client tcp_user_timeout in seconds: unacknowledged data declares the
    #: connection dead after this long.
    tcp_user_timeout: float = 5.0
    #: Server TCP keepalives on the lock session: the bound after which the
    #: server frees a cut-off holder's locks is about idle + interval * count.
    server_keepalives_idle: int = 4
    server_keepalives_interval: int = 2
    server_keepalives_count: int = 4
    #: Server tcp_user_timeout on the lock session, in seconds.
    server_tcp_user_timeout: float = 12.0
    #: Server client_connection_check_interval on the lock session, seconds.
    server_connection_check_interval: float = 3.0
    #: Seconds between checks that a running step's lock session is alive,
    #: still holds its lock and is not on a server in recovery.
    check_interval: float = 2.0
    #: What a task does when its lock is lost: "interrupt" (LockLost raised
    #: inside the running body), "raise" (LockLost at the next use of the lock)
    #: or "terminate" (the worker process ends at once).
    on_lost: str = "interrupt"
    #: Where lock sessions come from: "reuse" (a few idle lock-only sessions
    #: per process, checked out by one holder at a time) or "connect" (a new
    #: session for every lock, closed on release).
    strategy: str = "reuse"
    #: Idle lock sessions a process keeps per DSN with the "reuse" strategy.
    idle_sessions: int = 2
    #: Lock sessions a process shares among its locks per DSN with the "shared"
    #: strategy, however many calls run at once.
    shared_sessions: int = 4
    #: Countdown in seconds before a lock_mode="retry" call tries again.
    retry_countdown: float = 5.0
    #: Whether a skip looks up and reports who holds the lock (one query).
    report_holder: bool = True
    #: "none": a lock session must be a direct connection to Postgres (anything
    #: in between is refused); "session": it goes through a session-mode pooler
    #: (PgBouncer pool_mode = session), which keeps one backend per client.
    pooler: str = "none"
    #: The REST API URLs of the Patroni cluster's members (comma-separated): a
    #: lock is valid only while its server is confirmed as the leader (patroni.py).
    patroni_url: tuple[str, ...] | None = None
    #: PEM files for the Patroni REST API over HTTPS (patroni.tls_context): the CA
    #: that signs the members' certificates, and a client certificate and its key for
    #: restapi.verify_client; used by the fence and the doctor, nothing process-wide.
    patroni_cafile: str | None = None
    patroni_certfile: str | None = None
    patroni_keyfile: str | None = None
    #: A Django database alias: without pglock_dsn, the lock's DSN comes from its
    #: DATABASES entry; a task body's ORM writes to it are fenced by its lock.
    database: str | None = None
    #: Locks spread over several databases (shards.py), each the authority for its
    #: share: shard name -> DSN, or DSN and Patroni URLs. Kept out of repr().
    shards: tuple[Shard, ...] | None = dataclasses.field(default=None, repr=False)
    #: Places a lock name on a shard before the hash does (shards.py).
    shard_rule: Rule | None = dataclasses.field(default=None, repr=False)
    #: During a change of the shards: the map the fleet moves from. A name whose
    #: database differs between the two maps is locked on both, this one's first.
    shards_previous: tuple[Shard, ...] | None = dataclasses.field(default=None, repr=False)
    #: How the project names each setting (field name -> ``CELERY_PGLOCK_DSN``,
    #: ``PGLOCK_DSN``...), as load_config found them; not a field: kept by named().
    written: InitVar[Mapping[str, str] | None] = None

    def __post_init__(self, written: Mapping[str, str] | None) -> None:
        """Refuse a value that no lock session could use, as load_config does.

        A config built directly (``AdvisoryLock(config=PglockConfig(...))``) skips
        load_config: every field but the DSN (checked at the first lock, never
        shown) and the Patroni URLs goes through its parser here, and is kept as
        parsed (``keepalives_idle=1.0`` becomes 1, ``strategy="bogus"`` is refused).
        """
        self.__dict__["_written"] = dict(written or {})
        problems: list[str] = []
        for name, parse in _PARSERS.items():
            if name in ("dsn", "patroni_url", "shard_rule"):
                continue
            value = getattr(self, name)
            try:
                parsed = parse(value)
            except (TypeError, ValueError) as exc:
                problems.append(f"{name}={value!r}: {exc}")
                continue
            if type(parsed) is not type(value) or parsed != value:
                object.__setattr__(self, name, parsed)
        if problems:
            raise ConfigurationError(f"invalid PglockConfig: {'; '.join(problems)}")
        try:
            tls_context(
                self.patroni_cafile, self.patroni_certfile, self.patroni_keyfile, named=self.named
            )
        except ValueError as exc:
            raise ConfigurationError(f"invalid setting {exc}") from None
        if self.shard_rule is not None and not callable(self.shard_rule):
            object.__setattr__(self, "shard_rule", parse_rule(self.shard_rule))
        if self.shard_rule is not None and not isinstance(
            getattr(self.shard_rule, "__qualname__", None), str
        ):
            raise ConfigurationError(
                f"invalid setting {self.named('shard_rule')}={self.shard_rule!r}: must be a "
                "function (or 'module:function' naming one): its module and name are part "
                "of the shard map's identity, the same in every worker process, and this "
                "callable has no name (a functools.partial, an instance)"
            )
        _refuse_mixed_shards(self)
        if self.database is not None:
            object.__setattr__(self, "dsn", _database_dsn(self))
        # Not a field: each shard's configuration (a copy) keeps its whole map's.
        identity = map_identity(self.shards, self.shards_previous, self.shard_rule, self.dsn)
        object.__setattr__(self, "_map", identity)

    def named(self, setting: str) -> str:
        """The name of ``setting`` (a field: ``"dsn"``) as the project wrote it.

        The key or variable its value came from, else the key the app would read
        (``CELERY_PGLOCK_DSN`` under namespace ``CELERY``); ``pglock_<setting>`` for a
        config built directly. For messages only: nothing decides on it.
        """
        names: dict[str, str] = self.__dict__.get("_written") or {}
        return names.get(setting) or f"pglock_{setting}"

    def _rename(self, setting: str, name: str) -> None:
        """Name ``setting`` ``name`` in this config's messages (its copies keep their own)."""
        self.__dict__["_written"] = {**(self.__dict__.get("_written") or {}), setting: name}

    @property
    def map_identity(self) -> MapIdentity | None:
        """The shard map that this configuration's lock sessions record on their
        database (rollout.py): the whole map's (with the previous one during a change
        of the shards), also in each shard's configuration."""
        found: MapIdentity | None = self.__dict__.get("_map")
        return found

    @property
    def server_bound(self) -> float:
        """Seconds after which the server frees a cut-off holder's locks, at most.

        Keepalives (or tcp_user_timeout, with data in flight) declare the socket
        dead; a backend busy in a statement notices at its next connection check.
        """
        keepalive = self.server_keepalives_idle + (
            self.server_keepalives_interval * self.server_keepalives_count
        )
        dead = max(float(keepalive), self.server_tcp_user_timeout)
        return dead + self.server_connection_check_interval

    @property
    def client_bound(self) -> float:
        """Seconds after which a cut-off holder learns that its lock is lost, at most.

        An idle session is checked every check_interval (the first check comes
        within 1.25 intervals), and the check's unacknowledged query fails after
        tcp_user_timeout; a session waiting on a statement learns from its
        keepalives.
        """
        keepalive = self.keepalives_idle + self.keepalives_interval * self.keepalives_count
        return max(1.25 * self.check_interval + self.tcp_user_timeout, float(keepalive))

    def require_dsn(self) -> str:
        """Return the DSN, or raise ConfigurationError saying what is wrong with it.

        A DSN that does not parse cleanly never reaches libpq, whose messages
        would quote the parts it mis-parsed (pieces of a URI password among them).
        """
        if not self.dsn and self.shards is not None:
            raise ConfigurationError(
                f"{self.named('shards')} spreads the locks over several databases: this "
                "needs one shard's configuration (for_key, for_shard), or a DSN given"
            )
        if not self.dsn:
            raise ConfigurationError(
                f"no lock database configured: set the Celery setting {self.named('dsn')} "
                "or the environment variable PGLOCK_DSN (under Django, "
                f"{self.named('database')} may name a DATABASES alias instead)"
            )
        problem = dsn_problem(self.dsn)
        if problem is not None:
            raise ConfigurationError(
                f"the lock database's DSN ({self.named('dsn')}) is not a valid connection "
                f"string: {problem}; its text is not shown. Keep the password out of the "
                "DSN: PGPASSWORD or a passfile (PGPASSFILE)"
            )
        return self.dsn

    def with_dsn(self, dsn: str | None) -> PglockConfig:
        """Return this config with ``dsn`` in place of its own, when given.

        A copy, not checked again: its numbers are this config's, checked when it was
        built (a few microseconds saved on every lock given a DSN), and require_dsn
        checks the DSN at use, naming it "the dsn given".
        """
        if dsn is None:
            return self
        config = copy.copy(self)
        object.__setattr__(config, "dsn", dsn)  # frozen: as dataclasses' own __init__ does
        config._rename("dsn", "the dsn given")
        # A DSN named is one database: no shards, whatever the settings spread.
        object.__setattr__(config, "shards", None)
        object.__setattr__(config, "shard_rule", None)
        object.__setattr__(config, "shards_previous", None)
        for attribute in ("_placed", "_previous"):
            config.__dict__.pop(attribute, None)
        return config

    def shard_of(self, key: int, name: str | None = None) -> str:
        """The name of the shard that the lock ``key`` (named ``name``) lives on.

        DEFAULT without shards. ``pglock_shard_rule`` places a name first, then
        rendezvous hashing on the key; cached per configuration (a rule must give one
        answer per name). A bare key under a rule is refused (LockNameError): the rule
        places names, and a key its name was placed by could land elsewhere.
        """
        if self.shards is None:
            return DEFAULT
        placed: dict[tuple[int, str | None], str] = self.__dict__.setdefault("_placed", {})
        found = placed.get((key, name))
        if found is None:
            found = self._place(key, name)
            if len(placed) >= _MOST_PLACED:
                placed.clear()  # bounded: a process's names beyond it are placed again
            placed[(key, name)] = found
        return found

    def _place(self, key: int, name: str | None) -> str:
        assert self.shards is not None
        names = [shard.name for shard in self.shards]
        if self.shard_rule is not None:
            if name is None:
                raise LockNameError(
                    f"lock #{key}: with {self.named('shard_rule')}, a lock is taken by its "
                    "name: the rule places names, and a bare key could land on another shard"
                )
            try:
                chosen = self.shard_rule(name)
            except Exception as exc:
                raise ConfigurationError(
                    f"{self.named('shard_rule')} raised {type(exc).__name__} placing lock "
                    f"{name!r}: nothing is locked (a rule must give a shard name, or None "
                    "for the hash)"
                ) from exc
            if chosen is not None and chosen not in names and self.__dict__.get("_is_previous"):
                # A shard the change adds: before it, such a name was placed by the hash.
                chosen = None
            if chosen is not None:
                if chosen not in names:
                    raise ConfigurationError(
                        f"{self.named('shard_rule')} placed lock {name!r} on shard {chosen!r}, "
                        f"which {self.named('shards')} does not name (it names "
                        f"{', '.join(names)})"
                    )
                return str(chosen)
        return rendezvous(key, names)

    def previous_for_key(self, key: int, name: str | None = None) -> PglockConfig | None:
        """During a change of the shards (``pglock_shards_previous``): the configuration
        of the lock's shard in the previous map when its database is not the one of
        its shard now (a moving name, locked on both); else None."""
        before = self.previous_map()
        if before is None:
            return None
        then, now = before.for_key(key, name), self.for_key(key, name)
        same = (then.dsn, then.patroni_url) == (now.dsn, now.patroni_url)
        return None if same else then

    def previous_map(self) -> PglockConfig | None:
        """During a change of the shards: this configuration with the previous map as
        its shards (its lock sessions still record this one's map); else None."""
        if self.shards_previous is None:
            return None
        before = self.__dict__.get("_previous")
        if before is None:
            before = copy.copy(self)
            for attribute in ("_placed", "_shard_configs", "_previous"):
                before.__dict__.pop(attribute, None)
            object.__setattr__(before, "shards", self.shards_previous)
            object.__setattr__(before, "shards_previous", None)
            before.__dict__["_is_previous"] = True
            self.__dict__["_previous"] = before
        return before

    def for_named_shard(self, label: str) -> PglockConfig:
        """The configuration of shard ``label`` of this map, else of the previous one (a
        shard being removed; ``NAME (previous map)``: a moved shard's old database)."""
        names = {shard.name for shard in self.shards or ()}
        before = self.previous_map()
        base = label.removesuffix(PREVIOUS_MARK)
        if label in names or before is None:
            return self.for_shard(label)
        return before.for_shard(base)

    def for_key(self, key: int, name: str | None = None) -> PglockConfig:
        """The configuration of the shard the lock ``key`` (named ``name``) lives on:
        this one without shards."""
        if self.shards is None:
            return self
        return self.for_shard(self.shard_of(key, name))

    def for_shard(self, name: str) -> PglockConfig:
        """The configuration of shard ``name``: its DSN and its own Patroni URLs, every
        other setting this one's (one per shard, so one source and one fence each)."""
        configs: dict[str, PglockConfig] = self.__dict__.setdefault("_shard_configs", {})
        found = configs.get(name)
        if found is None:
            shard = next((s for s in self.shards or () if s.name == name), None)
            if shard is None:
                raise ConfigurationError(f"{self.named('shards')} names no shard {name!r}")
            shards = self.named("shards")
            found = self.with_dsn(shard.dsn)
            found._rename("dsn", f"the DSN of shard {name!r} of {shards}")
            found.__dict__.pop("_shard_configs", None)
            object.__setattr__(found, "patroni_url", shard.patroni_url)
            found._rename("patroni_url", f"the patroni_url of shard {name!r} of {shards}")
            for setting in TLS_SETTINGS:  # the shard's own file, else the map's
                own = getattr(shard, setting) or getattr(self, setting)
                object.__setattr__(found, setting, own)
            configs[name] = found
        return found

    def each_shard(self) -> tuple[tuple[str, PglockConfig], ...]:
        """Every shard's name and configuration; (DEFAULT, this one) without shards."""
        if self.shards is None:
            return ((DEFAULT, self),)
        return tuple((shard.name, self.for_shard(shard.name)) for shard in self.shards)


#: How many placements a configuration keeps (shard_of's cache).
_MOST_PLACED = 65536


def _refuse_mixed_shards(config: PglockConfig) -> None:
    """pglock_shards names every lock database: with it, no other setting names one."""
    shards = config.named("shards")
    if config.shards is None:
        alone = [
            setting
            for setting, value in (
                ("shard_rule", config.shard_rule),
                ("shards_previous", config.shards_previous),
            )
            if value is not None
        ]
        if alone:
            raise ConfigurationError(f"{config.named(alone[0])} is set without {shards}")
        return
    for setting, value in (
        ("dsn", config.dsn),
        ("database", config.database),
        ("patroni_url", config.patroni_url),
    ):
        if value:
            raise ConfigurationError(
                f"{shards} and {config.named(setting)} are both set: {shards} names each "
                "shard's DSN (and its patroni_url); set one or the other"
            )


def _database_dsn(config: PglockConfig) -> str:
    """The lock DSN with ``pglock_database`` set: pglock_dsn when given, else the alias's.

    Read from Django's settings when the config is built (the first lock, a worker's
    start, ``manage.py check``), never at import. A pglock_dsn given too says how the
    locks reach the database (past a pooler the ORM uses, say): it must name the
    alias's database, since the body's ORM writes go through the lock's session.
    """
    alias, dsn = config.database, config.dsn
    assert alias is not None
    database = config.named("database")
    if config.strategy == "shared":
        raise ConfigurationError(
            f"{database} needs a lock session of the holder's own: a shared session "
            f"gives no fenced writes; set {config.named('strategy')} to 'reuse' or 'connect'"
        )
    try:
        from .django import dsn as django_dsn
    except ModuleNotFoundError as exc:
        if exc.name != "django" and not (exc.name or "").startswith("django."):
            raise
        raise ConfigurationError(
            f"invalid setting {database}={alias!r}: it names a Django database, and Django "
            f"is not installed: pip install django (or leave {database} unset and give the "
            f"lock database in {config.named('dsn')})"
        ) from None
    try:
        own = django_dsn(alias)
    except ConfigurationError as exc:
        raise ConfigurationError(f"invalid setting {database}={alias!r}: {exc}") from None
    if dsn is None:
        config._rename("dsn", f"DATABASES[{alias!r}] ({database})")
        return own
    ours, theirs = _dbname(dsn), _dbname(own)
    if ours is not None and theirs is not None and ours != theirs:
        raise ConfigurationError(
            f"{config.named('dsn')} names the database {ours!r}, {database}={alias!r} the "
            f"database {theirs!r}: the body's ORM writes go through the lock's session, so "
            "both must name one database"
        )
    return dsn


def _dbname(dsn: str) -> str | None:
    """The database a DSN names, None when it names none or does not parse."""
    try:
        name = conninfo_to_dict(dsn).get("dbname")
    except psycopg.Error:
        return None
    return None if name is None else str(name)


_KEEPIDLE = _keepalive("TCP_KEEPIDLE", 32767)
_KEEPINTVL = _keepalive("TCP_KEEPINTVL", 32767)
_KEEPCNT = _keepalive("TCP_KEEPCNT", 127)
_USER_TIMEOUT = _milliseconds("would mean the system's default")

_PARSERS: dict[str, Callable[[Any], Any]] = {
    "dsn": _dsn,
    "connect_timeout": _connect_timeout,
    "application_name": _application_name,
    "keepalives_idle": _KEEPIDLE,
    "keepalives_interval": _KEEPINTVL,
    "keepalives_count": _KEEPCNT,
    "tcp_user_timeout": _USER_TIMEOUT,
    "server_keepalives_idle": _KEEPIDLE,
    "server_keepalives_interval": _KEEPINTVL,
    "server_keepalives_count": _KEEPCNT,
    "server_tcp_user_timeout": _USER_TIMEOUT,
    "server_connection_check_interval": _milliseconds("would turn the check off"),
    "check_interval": _check_interval,
    "on_lost": _reaction,
    "strategy": _strategy,
    "idle_sessions": _whole,
    "shared_sessions": _positive_int,
    "retry_countdown": retry_countdown,
    "report_holder": _boolean,
    "pooler": _pooler,
    "patroni_url": _patroni_url,
    "patroni_cafile": readable_file,
    "patroni_certfile": readable_file,
    "patroni_keyfile": readable_file,
    "database": _database,
    "shards": parse_shards,
    "shard_rule": parse_rule,
    "shards_previous": parse_shards,
}

#: Every setting: (app.conf key, environment variable, default).
SETTINGS: tuple[tuple[str, str, Any], ...] = tuple(
    (f"pglock_{field.name}", f"PGLOCK_{field.name.upper()}", field.default)
    for field in dataclasses.fields(PglockConfig)
)


def _written_as(conf: Any, key: str) -> str:
    """Return the name under which ``conf`` holds ``key``, as the user wrote it.

    Celery looks a key up map by map, its namespaced form first
    (``CELERY_PGLOCK_X`` under ``namespace="CELERY"``); so does this.
    """
    namespaced = _namespaced(getattr(conf, "prefix", None), key)
    for mapping in getattr(conf, "maps", None) or [conf]:
        for name in (namespaced, key):
            if name is not None and name in mapping:
                return name
    return key


def _namespaced(prefix: str | None, key: str) -> str | None:
    if not prefix:
        return None
    name = prefix + key
    # Celery's own rule: the namespaced key takes the case of the prefix.
    return name.upper() if prefix.isupper() else name.lower()


def _lookup(conf: Any, environ: Mapping[str, str], setting: str) -> tuple[Any, str]:
    """The raw value of ``setting`` (a field: ``dsn``; None when unset) and its name as
    the project wrote it: its key in ``conf``, else its variable, else (unset) the key
    ``conf`` would read (namespaced when it has a namespace)."""
    key, env = f"pglock_{setting}", f"PGLOCK_{setting.upper()}"
    raw = conf.get(key) if conf is not None else None
    if raw is not None:
        return raw, _written_as(conf, key)
    if environ.get(env) not in (None, ""):
        return environ[env], env
    # Read after conf.get: a Celery conf knows its namespace once it is finalized.
    return None, _namespaced(getattr(conf, "prefix", None), key) or key


def setting_name(conf: Any, setting: str, environ: Mapping[str, str] | None = None) -> str:
    """How the project names ``setting`` (``"pooler"``) with ``conf`` and the environment:
    ``CELERY_PGLOCK_POOLER``, ``PGLOCK_POOLER``, ``pglock_pooler``, as load_config does."""
    return _lookup(conf, os.environ if environ is None else environ, setting)[1]


def load_config(conf: Any, environ: dict[str, str] | None = None) -> PglockConfig:
    """Build a PglockConfig from a Celery ``conf`` mapping and the environment.

    Raises ConfigurationError naming every value that does not parse, as the
    user wrote its key (``CELERY_PGLOCK_X``, ``PGLOCK_X``), and why.
    """
    environ = dict(os.environ) if environ is None else environ
    values: dict[str, Any] = {}
    names: dict[str, str] = {}
    problems: list[str] = []
    for field in dataclasses.fields(PglockConfig):
        raw, names[field.name] = _lookup(conf, environ, field.name)
        if raw is None:
            continue
        try:
            values[field.name] = _PARSERS[field.name](raw)
        except (TypeError, ValueError) as exc:
            hidden = ("dsn", "patroni_url", "shards", "shards_previous")
            shown = "<hidden>" if field.name in hidden else repr(raw)
            problems.append(f"{names[field.name]}={shown}: {exc}")
    if problems:
        if len(problems) == 1:
            raise ConfigurationError(f"invalid setting {problems[0]}")
        raise ConfigurationError(f"invalid settings: {'; '.join(problems)}")
    return PglockConfig(**values, written=names)


_KEYS = tuple(key for key, _env, _default in SETTINGS)
_VARIABLES = tuple(env for _key, env, _default in SETTINGS)


@functools.lru_cache(maxsize=8)
def _names(prefix: str | None) -> tuple[tuple[str, ...], frozenset[str]]:
    """Every name under which a conf with ``prefix`` may hold a pglock setting."""
    namespaced = (_namespaced(prefix, key) for key in _KEYS)
    names = _KEYS + tuple(name for name in namespaced if name is not None)
    return names, frozenset(names)


@functools.lru_cache(maxsize=2)
def _encoded_variables(encodekey: Callable[[str], Any]) -> tuple[Any, ...]:
    return tuple(encodekey(env) for env in _VARIABLES)


def _fingerprint(conf: Any) -> tuple[object, ...]:
    """The raw values that load_config would read from ``conf`` and the environment.

    Read straight from the maps behind Celery's conf, whose own lookup costs
    microseconds per key: a map without any pglock name costs one set operation.
    """
    names, name_set = _names(getattr(conf, "prefix", None))
    parts: list[object] = []
    for mapping in getattr(conf, "maps", None) or [conf]:
        if type(mapping) is not dict:
            attributes = (
                getattr(mapping.obj, "__dict__", None)
                if isinstance(mapping, DictAttribute)
                else None
            )
            if not isinstance(attributes, (dict, MappingProxyType)):
                parts.append(tuple(mapping.get(name) for name in names))
                continue
            # A config object (module, class, Django settings): its own attributes
            # (not inherited ones), and what a lazy wrapper wraps (Django's
            # override_settings swaps it).
            parts.append(attributes.get("_wrapped"))
            mapping = attributes
        disjoint = mapping.keys().isdisjoint(name_set)
        parts.append(None if disjoint else tuple(map(mapping.get, names)))
    environ = os.environ
    # os.environ encodes the key at every lookup; its backing dict does not need to.
    data = getattr(environ, "_data", None)
    encodekey = getattr(environ, "encodekey", None)
    if isinstance(data, dict) and encodekey is not None:
        parts.append(tuple(map(data.get, _encoded_variables(encodekey))))
    else:
        parts.append(tuple(map(environ.get, _VARIABLES)))
    return tuple(parts)


def get_config(app: Celery) -> PglockConfig:
    """Return the app's PglockConfig, cached on the app until a raw value changes.

    A value set after the first call (app.conf, the app's config object, a
    ``PGLOCK_*`` variable) counts from the next call on.
    """
    conf = app.conf
    fingerprint = _fingerprint(conf)
    cached: tuple[tuple[object, ...], PglockConfig] | None = getattr(app, _CACHE_ATTRIBUTE, None)
    if cached is not None and cached[0] == fingerprint:
        return cached[1]
    finalize = getattr(conf, "finalize", None)
    if finalize is not None:
        # A conf not yet read swaps in its real maps at the first lookup: take the
        # fingerprint from those, or the next call would read everything again.
        finalize()
        fingerprint = _fingerprint(conf)
        if cached is not None and cached[0] == fingerprint:
            return cached[1]
    # Taken before reading: a change made while reading shows at the next call.
    config = load_config(conf)
    setattr(app, _CACHE_ATTRIBUTE, (fingerprint, config))
    return config


def _mask_in_celery_reports() -> None:
    """Make Celery mask pglock_dsn where it masks secrets (celery report, inspect conf).

    Celery masks a setting whose name matches ``celery.app.utils.HIDDEN_SETTINGS``,
    looked up at each use (Celery 5.3 to 5.7). A Celery without it is left
    alone; the README says how to keep the password out of the DSN anyway.
    """
    hidden = getattr(celery.app.utils, "HIDDEN_SETTINGS", None)
    if isinstance(hidden, re.Pattern) and not hidden.search("celery_pglock_dsn"):
        extended = re.compile(f"{hidden.pattern}|(?i:PGLOCK_DSN|PGLOCK_SHARDS)", hidden.flags)
        # (PGLOCK_SHARDS matches PGLOCK_SHARDS_PREVIOUS too.)
        # setattr: celery-types does not declare HIDDEN_SETTINGS.
        setattr(celery.app.utils, "HIDDEN_SETTINGS", extended)  # noqa: B010
    # A mapping's value is masked by its own keys only (Celery goes into it), and a
    # shard map's keys are shard names: pglock_shards (and _previous) are masked whole,
    # under whatever namespace the app reads its settings (CELERY_, PROJ_, none).
    censor = getattr(celery.app.utils, "filter_hidden_settings", None)
    if callable(censor) and not getattr(censor, "_masks_pglock_shards", False):

        def filter_hidden_settings(conf: Any) -> Any:
            whole = {key: "*" * 8 if _is_shard_map(key) else value for key, value in conf.items()}
            return censor(whole)

        filter_hidden_settings._masks_pglock_shards = True  # type: ignore[attr-defined]
        setattr(celery.app.utils, "filter_hidden_settings", filter_hidden_settings)  # noqa: B010


#: The settings whose value is a shard map (DSNs, with their passwords, inside).
_SHARD_MAPS = ("pglock_shards", "pglock_shards_previous")


def _is_shard_map(key: object) -> bool:
    """Whether ``key`` names a shard map setting: bare, or under any namespace (``X_``)."""
    if not isinstance(key, str):
        return False
    lowered = key.lower()
    return any(lowered == name or lowered.endswith("_" + name) for name in _SHARD_MAPS)


_mask_in_celery_reports()
