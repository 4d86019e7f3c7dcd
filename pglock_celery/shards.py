"""Which shard a lock lives on: the one rule the lock path asks for a lock's database.

``pglock_shards`` maps shard names to DSNs, or to a DSN and the Patroni URLs of that
shard's cluster (each shard its own authority, its own fence)::

    app.conf.pglock_shards = {
        "a": "host=pg-a dbname=app",
        "b": {"dsn": "host=pg-b1,pg-b2 dbname=app", "patroni_url": "http://pg-b1:8008,..."},
    }

A lock goes to the shard that ranks first for its key by rendezvous hashing (each
shard's score is a hash of its name and the key): adding a shard moves only the names
it now ranks first for (about 1/N of them, all to it), removing one moves only its own.
``pglock_shard_rule`` (a callable, or ``"module:function"``) may place a name first,
for names that must live with data already placed: it returns a shard's name, or None
to leave the name to the hash. ``pglock_dsn`` alone is one shard, named
:data:`DEFAULT`.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib
import json
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .dsn import dsn_problem
from .leader import parse_setting as parse_leader_setting
from .tls import TLS_SETTINGS, readable_file, tls_context

__all__ = ["DEFAULT", "Shard", "parse_rule", "parse_shards", "rendezvous"]

#: The name of the one shard that ``pglock_dsn`` alone is.
DEFAULT = "default"
#: What a shard's name may be made of (it appears in messages, metrics and commands).
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}")
#: A rule returns a shard's name for a lock's name, or None (the hash decides).
Rule = Callable[[str], "str | None"]


@dataclasses.dataclass(frozen=True)
class Shard:
    """One shard: its name, its lock database, and its cluster's Patroni URLs if fenced.

    The DSN and the URLs stay out of repr() (a DSN may hold a password).
    """

    name: str
    dsn: str = dataclasses.field(repr=False)
    patroni_url: tuple[str, ...] | None = dataclasses.field(default=None, repr=False)
    #: The TLS files of its cluster's REST API (tls.py); unset: the map's own settings.
    patroni_cafile: str | None = None
    patroni_certfile: str | None = None
    patroni_keyfile: str | None = None


#: How a moved shard's database of the previous map is named beside the new one's.
PREVIOUS_MARK = " (previous map)"


def previous_label(name: str) -> str:
    """``NAME (previous map)``: shard ``name``'s database in the previous map."""
    return f"{name}{PREVIOUS_MARK}"


class _NamedTwice(Exception):
    """A JSON object gives one key twice (json keeps the last, silently)."""


def _once_each(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for key, value in pairs:
        if key in found:
            raise _NamedTwice(repr(key))
        found[key] = value
    return found


def parse_shards(raw: Any) -> tuple[Shard, ...] | None:
    """``pglock_shards``'s value: a mapping (or its JSON text, the environment's form)
        of shard name to a DSN, or to ``{"dsn": ..., "patroni_url": ...}`` (with the
    ``patroni_cafile``, ``patroni_certfile`` and ``patroni_keyfile`` of its cluster's REST
    API if they differ from the map's settings), or to a pair
        ``(dsn, patroni_url)``. None when unset. ValueError saying which shard is wrong and
        why, never quoting a DSN."""
    if raw is None or raw == "":
        return None
    if isinstance(raw, tuple) and raw and all(isinstance(shard, Shard) for shard in raw):
        return _distinct(raw)  # parsed already (a PglockConfig made from another)
    if isinstance(raw, str):
        try:
            raw = json.loads(raw, object_pairs_hook=_once_each)
        except _NamedTwice as exc:
            raise ValueError(
                f"gives {exc} twice (JSON keeps the last): which one is meant?"
            ) from None
        except ValueError:
            raise ValueError(
                "must be a JSON object of shard name to DSN (in the environment)"
            ) from None
    if not isinstance(raw, Mapping) or not raw:
        raise ValueError("must be a non-empty mapping of shard name to DSN")
    shards = []
    for name, value in raw.items():
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise ValueError(
                f"shard name {name!r} must be letters, digits, '_', '.' or '-' (up to 63), "
                "starting with a letter or digit"
            )
        dsn, urls = _shard_value(name, value)
        shards.append(Shard(name, dsn, urls, *_shard_tls(name, value)))
    return tuple(shards)


def _distinct(shards: tuple[Shard, ...]) -> tuple[Shard, ...]:
    names = [shard.name for shard in shards]
    doubled = sorted({name for name in names if names.count(name) > 1})
    if doubled:
        raise ValueError(f"shard names must differ: {', '.join(doubled)} given twice")
    return shards


def _shard_value(name: str, value: Any) -> tuple[str, tuple[str, ...] | None]:
    dsn: Any
    urls: Any
    if isinstance(value, str):
        dsn, urls = value, None
    elif isinstance(value, Mapping):
        unknown = set(value) - {"dsn", "patroni_url", *TLS_SETTINGS}
        if unknown:
            raise ValueError(
                f"shard {name!r}: unknown keys {sorted(unknown)} "
                f"({', '.join(('dsn', 'patroni_url', *TLS_SETTINGS))})"
            )
        dsn, urls = value.get("dsn"), value.get("patroni_url")
    elif isinstance(value, (list, tuple)) and len(value) == 2:
        dsn, urls = value
    else:
        raise ValueError(
            f"shard {name!r}: must be a DSN, {{'dsn': ..., 'patroni_url': ...}} or a pair"
        )
    if not isinstance(dsn, str) or not dsn.strip():
        raise ValueError(f"shard {name!r}: its DSN must be a non-empty str")
    problem = dsn_problem(dsn)
    if problem is not None:
        raise ValueError(f"shard {name!r}: its DSN is not valid ({problem}); not shown")
    if urls in (None, ""):
        return dsn, None
    try:
        return dsn, parse_leader_setting("patroni_url", urls)
    except ValueError as exc:
        raise ValueError(f"shard {name!r}: its patroni_url: {exc}") from None


def _shard_tls(name: str, value: Any) -> tuple[str | None, ...]:
    """A shard's own TLS files for its Patroni REST API (a mapping's keys), checked."""
    if not isinstance(value, Mapping):
        return (None,) * len(TLS_SETTINGS)
    files = []
    for setting in TLS_SETTINGS:
        try:
            files.append(readable_file(value.get(setting)))
        except ValueError as exc:
            raise ValueError(f"shard {name!r}: its {setting}: {exc}") from None
    try:
        tls_context(*files)
    except ValueError as exc:
        raise ValueError(f"shard {name!r}: {exc}") from None
    return tuple(files)


def parse_rule(raw: Any) -> Rule | None:
    """``pglock_shard_rule``: a callable, or the ``"module:function"`` naming one."""
    if raw is None or raw == "":
        return None
    if callable(raw):
        return raw  # type: ignore[no-any-return]
    if not isinstance(raw, str) or raw.count(":") != 1:
        raise ValueError("must be a callable, or 'module:function' naming one")
    module, attribute = raw.split(":")
    try:
        found = getattr(importlib.import_module(module), attribute)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"{raw!r} names no function ({type(exc).__name__})") from None
    if not callable(found):
        raise ValueError(f"{raw!r} is not callable")
    return found  # type: ignore[no-any-return]


def rendezvous(key: int, names: Sequence[str]) -> str:
    """The shard name that ranks first for ``key`` (highest random weight).

    Each shard's score is the 8-byte BLAKE2b digest of ``"<name>\0<key>"`` (the key in
    decimal), compared as a big-endian number, ties going to the greater name: the rule
    that places every name, so it never changes. The hash of each ``"<name>\0"`` is
    kept and copied, the key's text made once.
    """
    text = str(key).encode()
    best, chosen = b"", ""
    for name in names:
        hashed = _prefix(name).copy()
        hashed.update(text)
        digest = hashed.digest()
        if (digest, name) > (best, chosen):
            best, chosen = digest, name
    return chosen


@functools.lru_cache(maxsize=1024)
def _prefix(name: str) -> Any:
    return hashlib.blake2b(f"{name}\0".encode(), digest_size=8)
