"""pglock_* settings: read once per Celery app from app.conf, then the environment.

Each setting is looked up as the lowercase ``pglock_*`` key in ``app.conf``,
then as the uppercase ``PGLOCK_*`` environment variable, then its default.
A value that does not parse is reported (a warning and a log line) and the
default is used instead, except for ``pglock_dsn``, whose absence is an error
at the first lock.

Importing this module also makes Celery mask ``pglock_dsn`` wherever it masks
secret settings (``celery report``, ``celery inspect conf``).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import celery.app.utils
from celery import Celery

from .dsn import dsn_problem
from .exceptions import ConfigurationError

logger = logging.getLogger("pglock_celery.config")

_CACHE_ATTRIBUTE = "_pglock_config"


def _positive_float(raw: Any) -> float:
    value = float(raw)
    if not value > 0:
        raise ValueError("must be greater than 0")
    return value


def _positive_int(raw: Any) -> int:
    value = int(raw)
    if value <= 0:
        raise ValueError("must be a whole number greater than 0")
    return value


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


def _reaction(raw: Any) -> str:
    text = str(raw).strip().lower()
    if text not in ("raise", "terminate"):
        raise ValueError("must be 'raise' or 'terminate'")
    return text


def _strategy(raw: Any) -> str:
    text = str(raw).strip().lower()
    if text not in ("connect", "reuse"):
        raise ValueError("must be 'connect' or 'reuse'")
    return text


def _whole(raw: Any) -> int:
    value = int(raw)
    if value < 0:
        raise ValueError("must be a whole number, 0 or more")
    return value


def _optional_str(raw: Any) -> str | None:
    return None if raw in (None, "") else str(raw)


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
    #: What a task does when its lock is lost: "raise" (LockLost at the next
    #: use of the lock) or "terminate" (the worker process ends at once).
    on_lost: str = "raise"
    #: Where lock sessions come from: "reuse" (a few idle lock-only sessions
    #: per process, checked out by one holder at a time) or "connect" (a new
    #: session for every lock, closed on release).
    strategy: str = "reuse"
    #: Idle lock sessions a process keeps per DSN with the "reuse" strategy.
    idle_sessions: int = 2
    #: Countdown in seconds before a lock_mode="retry" call tries again.
    retry_countdown: float = 5.0
    #: Whether a skip looks up and reports who holds the lock (one query).
    report_holder: bool = True

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
        if not self.dsn:
            raise ConfigurationError(
                "no lock database configured: set the Celery setting pglock_dsn "
                "or the environment variable PGLOCK_DSN"
            )
        problem = dsn_problem(self.dsn)
        if problem is not None:
            raise ConfigurationError(
                f"the lock database's DSN (pglock_dsn, PGLOCK_DSN or the dsn given) is not "
                f"a valid connection string: {problem}; its text is not shown. Keep the "
                "password out of the DSN: PGPASSWORD or a passfile (PGPASSFILE)"
            )
        return self.dsn

    def with_dsn(self, dsn: str | None) -> PglockConfig:
        """Return this config with ``dsn`` in place of its own, when given."""
        return self if dsn is None else dataclasses.replace(self, dsn=dsn)


_PARSERS: dict[str, Callable[[Any], Any]] = {
    "dsn": _optional_str,
    "connect_timeout": _positive_float,
    "application_name": _application_name,
    "keepalives_idle": _positive_int,
    "keepalives_interval": _positive_int,
    "keepalives_count": _positive_int,
    "tcp_user_timeout": _positive_float,
    "server_keepalives_idle": _positive_int,
    "server_keepalives_interval": _positive_int,
    "server_keepalives_count": _positive_int,
    "server_tcp_user_timeout": _positive_float,
    "server_connection_check_interval": _positive_float,
    "check_interval": _positive_float,
    "on_lost": _reaction,
    "strategy": _strategy,
    "idle_sessions": _whole,
    "retry_countdown": _positive_float,
    "report_holder": _boolean,
}

#: Every setting: (app.conf key, environment variable, default).
SETTINGS: tuple[tuple[str, str, Any], ...] = tuple(
    (f"pglock_{field.name}", f"PGLOCK_{field.name.upper()}", field.default)
    for field in dataclasses.fields(PglockConfig)
)


def load_config(conf: Any, environ: dict[str, str] | None = None) -> PglockConfig:
    """Build a PglockConfig from a Celery ``conf`` mapping and the environment."""
    environ = dict(os.environ) if environ is None else environ
    values: dict[str, Any] = {}
    for field in dataclasses.fields(PglockConfig):
        key, env = f"pglock_{field.name}", f"PGLOCK_{field.name.upper()}"
        raw = conf.get(key) if conf is not None else None
        source = key
        if raw is None and environ.get(env) not in (None, ""):
            raw, source = environ[env], env
        if raw is None:
            continue
        try:
            values[field.name] = _PARSERS[field.name](raw)
        except (TypeError, ValueError) as exc:
            shown = "<hidden>" if field.name == "dsn" else repr(raw)
            message = f"ignoring {source}={shown}: {exc}; using the default {field.default!r}"
            warnings.warn(message, RuntimeWarning, stacklevel=2)
            logger.warning(message, extra={"setting": key})
    return PglockConfig(**values)


def get_config(app: Celery) -> PglockConfig:
    """Return the app's PglockConfig, read once and cached on the app."""
    cached: PglockConfig | None = getattr(app, _CACHE_ATTRIBUTE, None)
    if cached is None:
        cached = load_config(app.conf)
        setattr(app, _CACHE_ATTRIBUTE, cached)
    return cached


def _mask_in_celery_reports() -> None:
    """Make Celery mask pglock_dsn where it masks secrets (celery report, inspect conf).

    Celery masks a setting whose name matches ``celery.app.utils.HIDDEN_SETTINGS``,
    looked up at each use (Celery 5.3 to 5.7). A Celery without it is left
    alone; the README says how to keep the password out of the DSN anyway.
    """
    hidden = getattr(celery.app.utils, "HIDDEN_SETTINGS", None)
    if isinstance(hidden, re.Pattern) and not hidden.search("celery_pglock_dsn"):
        extended = re.compile(f"{hidden.pattern}|(?i:PGLOCK_DSN)", hidden.flags)
        # setattr: celery-types does not declare HIDDEN_SETTINGS.
        setattr(celery.app.utils, "HIDDEN_SETTINGS", extended)  # noqa: B010


_mask_in_celery_reports()
