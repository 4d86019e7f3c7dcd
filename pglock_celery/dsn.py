"""DSN parsing and safe description: the one place that turns a DSN into text.

A DSN carries a password, and libpq's messages echo whatever it parsed out of the
DSN (a host, a port, a database name). When a URI password holds an unencoded
``/`` or ``@``, libpq parses it *wrongly but without complaint*: in
``postgresql://u:Pw9x/7Zq@h/db`` it sees host ``u``, port ``Pw9x`` and database
``7Zq@h/db``, and its messages then show pieces of the password. No pattern over
the text can undo that, so the rule here is structural:

- a DSN is used, described or quoted only when it parses *cleanly*: libpq
  accepts it, every port is a number, and a URI has no ``@`` after its host
  part (the mark of a mis-split password);
- a target is described only from the parsed host, port, database and user,
  never from the text, and never the password;
- a DSN that does not parse cleanly is shown as ``<malformed DSN>``, with a
  reason in our own words; libpq's text about it is dropped, since it may quote
  any part of the DSN;
- libpq's messages about a clean DSN are shown with every form of its password
  (as parsed, as written, percent-encoded, percent-decoded) replaced by ``***``.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from urllib.parse import quote, unquote

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo

#: How a DSN that does not parse cleanly is shown.
MALFORMED = "<malformed DSN>"
#: Replaces every form of a password in a message.
MASK = "***"

_URI_PREFIXES = ("postgresql://", "postgres://")

#: libpq's complaints about a DSN, by how they start, in our own words: libpq's
#: text quotes the offending part of the DSN, which may be the password.
_PARSE_ERRORS = (
    ('missing "=" after', 'a word without "=" (quote a value that holds spaces)'),
    ("unterminated quoted string", "a quoted value that is never closed"),
    ("invalid connection option", "an unknown parameter name"),
    ("invalid URI query parameter", "an unknown URI query parameter"),
    ("missing key/value separator", 'a URI query parameter without "="'),
    ("extra key/value separator", 'a URI query parameter with a second "="'),
    ("invalid percent-encoded token", 'a "%" in a URI that is not %XX (write "%" as %25)'),
    ("forbidden value %00", "a %00 in a URI"),
    ("unexpected spaces", "a space in a URI (write it as %20)"),
    ("end of string reached when looking for matching", 'an IPv6 address without its "]"'),
    ("IPv6 host address may not be empty", "an empty IPv6 address"),
    ("unexpected character", "an unexpected character in a URI"),
)

#: What a mis-split URI password looks like, and how to write it instead.
_MISSPLIT = (
    "an '@' after the host part of a URI: a password with '/' or '@' must be "
    "percent-encoded (/ as %2F, @ as %40)"
)


@dataclass(frozen=True)
class ParsedDsn:
    """What may be said about one DSN."""

    #: Why it does not parse cleanly, in our own words; None when it does.
    problem: str | None
    #: libpq's parameters; empty when the DSN does not parse cleanly.
    params: Mapping[str, str] = field(default_factory=dict, repr=False)
    #: Every form of its password that a message might hold, longest first.
    secrets: tuple[str, ...] = field(default=(), repr=False)


def _parse_error(exc: psycopg.Error) -> str:
    text = str(exc).strip()
    for start, ours in _PARSE_ERRORS:
        if text.startswith(start):
            return f"libpq cannot parse it: {ours}"
    return "libpq cannot parse it"


def _uri_parts(dsn: str) -> tuple[str, str] | None:
    """Return a URI's raw userinfo and what follows it, split the way libpq does."""
    for prefix in _URI_PREFIXES:
        if dsn.startswith(prefix):
            rest = dsn[len(prefix) :]
            # libpq takes everything before the first '@' as userinfo, unless a '/'
            # comes first.
            end = min((i for i in (rest.find("@"), rest.find("/")) if i >= 0), default=-1)
            if end >= 0 and rest[end] == "@":
                return rest[:end], rest[end + 1 :]
            return "", rest
    return None


def _problem(dsn: str, params: Mapping[str, str]) -> str | None:
    parts = _uri_parts(dsn)
    if parts is not None:
        after_userinfo = parts[1].split("?", 1)[0]
        hosts = f"{params.get('host') or ''}{params.get('hostaddr') or ''}"
        if "@" in after_userinfo or "@" in hosts:
            return _MISSPLIT
    for port in (params.get("port") or "").split(","):
        if port and not port.isdigit():
            return "a port that is not a number"
    return None


def _secrets(dsn: str, password: str) -> tuple[str, ...]:
    forms = {
        password,
        unquote(password),
        quote(password, safe=""),
        quote(password),
        password.replace("\\", "\\\\").replace("'", "\\'"),
    }
    parts = _uri_parts(dsn)
    if parts is not None:
        userinfo, rest = parts
        if ":" in userinfo:
            forms.add(userinfo.split(":", 1)[1])
        query = rest.split("?", 1)[1] if "?" in rest else ""
        for item in query.split("&"):
            key, _, value = item.partition("=")
            if key == "password":
                forms.add(value)
    return tuple(sorted((f for f in forms if f), key=len, reverse=True))


@functools.lru_cache(maxsize=64)
def parse_dsn(dsn: str) -> ParsedDsn:
    """Parse ``dsn`` with libpq and say whether, and what, it may show of it."""
    try:
        params = {k: str(v) for k, v in conninfo_to_dict(dsn).items()}
    except psycopg.Error as exc:
        return ParsedDsn(_parse_error(exc))
    problem = _problem(dsn, params)
    if problem is not None:
        return ParsedDsn(problem)
    password = params.get("password", "")
    return ParsedDsn(None, params, _secrets(dsn, password) if password else ())


@functools.lru_cache(maxsize=64)
def dsn_problem(dsn: str) -> str | None:
    """Return why ``dsn`` does not parse cleanly (never quoting it), or None."""
    return parse_dsn(dsn).problem


def describe_target(dsn: str) -> str:
    """Return ``host:port/dbname``, and ``as user`` when the DSN names one.

    Built from libpq's parse only (never the password); ``<malformed DSN>``
    when the DSN does not parse cleanly.
    """
    parsed = parse_dsn(dsn)
    if parsed.problem is not None:
        return MALFORMED
    params = parsed.params
    host = params.get("host") or params.get("hostaddr") or os.environ.get("PGHOST", "")
    hosts = host.split(",")
    ports = (params.get("port") or os.environ.get("PGPORT") or "5432").split(",")
    # libpq: one port serves every host; otherwise one port per host.
    ports = ports * len(hosts) if len(ports) == 1 else ports + [""] * (len(hosts) - len(ports))
    pairs = zip(hosts, ports[: len(hosts)], strict=True)
    where = ",".join(f"{h or 'local socket'}:{port or '5432'}" for h, port in pairs)
    dbname = params.get("dbname") or os.environ.get("PGDATABASE", "")
    target = f"{where}/{dbname}" if dbname else where
    user = params.get("user")
    return f"{target} as {user}" if user else target


#: The libpq parameters that choose which database a DSN reaches, with the environment
#: variable that stands in for each one left out.
DATABASE_PARAMETERS = {
    "service": "PGSERVICE",
    "host": "PGHOST",
    "hostaddr": "PGHOSTADDR",
    "port": "PGPORT",
    "dbname": "PGDATABASE",
    "user": "PGUSER",
}


def database_parameters(dsn: str) -> tuple[tuple[str, str], ...]:
    """The parameters of ``dsn`` that choose its database, as written (an unset one from
    its environment variable): ``service`` among them, never a password."""
    parsed = parse_dsn(dsn)
    if parsed.problem is not None:
        return (("malformed", MALFORMED),)
    found = []
    for name, variable in DATABASE_PARAMETERS.items():
        value = parsed.params.get(name) or os.environ.get(variable, "")
        if value:
            found.append((name, value))
    return tuple(found)


def database_address(dsn: str | None) -> tuple[str, ...] | None:
    """Where libpq takes ``dsn``'s locks, with its defaults (environment, user);
    None when it cannot be told without connecting."""
    if not dsn:
        return None
    parsed = parse_dsn(dsn)
    if parsed.problem is not None:
        return None
    params, env = parsed.params, os.environ
    user = params.get("user") or env.get("PGUSER") or ""
    dbname = params.get("dbname") or env.get("PGDATABASE") or user
    if not dbname:
        return None  # the operating system's user name: left to libpq
    return (
        params.get("host") or env.get("PGHOST", ""),
        params.get("hostaddr") or env.get("PGHOSTADDR", ""),
        params.get("port") or env.get("PGPORT") or "5432",
        params.get("service") or env.get("PGSERVICE", ""),
        dbname,
    )


def without_server(dsn: str, host: str, port: int) -> str | None:
    """``dsn`` without the server of its host list that ``host`` and ``port`` name (as
    libpq reports a connection's), its other servers in their order.

    None when it names no other server, or when its list cannot be narrowed: it does
    not parse cleanly, or its hosts or ports come from the environment.
    """
    parsed = parse_dsn(dsn)
    if parsed.problem is not None:
        return None
    params = dict(parsed.params)
    hosts = params["host"].split(",") if params.get("host") else []
    addresses = params["hostaddr"].split(",") if params.get("hostaddr") else []
    count = max(len(hosts), len(addresses))
    ports = (params.get("port") or "").split(",")
    ports = ports * count if len(ports) == 1 else ports
    if count < 2 or len(ports) != count or (hosts and addresses and len(hosts) != count):
        return None

    def server(at: int) -> tuple[str, str]:
        name = hosts[at] if hosts and hosts[at] else (addresses[at] if addresses else "")
        return name, ports[at] or "5432"

    keep = [at for at in range(count) if server(at) != (host, str(port))]
    if not keep or len(keep) == count:
        return None
    if hosts:
        params["host"] = ",".join(hosts[at] for at in keep)
    if addresses:
        params["hostaddr"] = ",".join(addresses[at] for at in keep)
    if params.get("port"):
        params["port"] = ",".join(ports[at] for at in keep)
    return make_conninfo(**params)


def redact(text: str, dsn: str | None) -> str:
    """Return ``text``, a message from libpq or psycopg about ``dsn``, safe to show.

    For a DSN that does not parse cleanly, libpq's text is dropped whole (it may
    quote any part of the DSN) and our own reason is given instead; otherwise
    every form of the DSN's password is replaced by ``***``.
    """
    if not dsn:
        return text
    parsed = parse_dsn(dsn)
    if parsed.problem is not None:
        return f"(libpq's message is not shown: the DSN does not parse cleanly: {parsed.problem})"
    for secret in parsed.secrets:
        text = text.replace(secret, MASK)
    return text
