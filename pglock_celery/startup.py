"""What a worker says at start about its locks: where they live, and whether it can reach there.

One line per lock database as the worker is ready (task.py's ``worker_ready`` handler,
logging set up):
host, port, database and role, the strategy, the leader fence if any; never a password
(a fence URL is shown without its user information). Then each database is tried once, on
a thread of its own so that the worker's consumer is not held up, with the configured
connect timeout; one that cannot be reached is a warning that says every locked task on it
will fail closed until it can. Nothing here is on a lock's path.
"""

from __future__ import annotations

import logging
import threading
import urllib.parse

import psycopg
from celery import Celery

from .config import PglockConfig, get_config
from .dsn import describe_target, redact
from .exceptions import ConfigurationError
from .shards import DEFAULT

logger = logging.getLogger("pglock_celery.task")

#: The application_name of the start-up check's short session: not a lock session's.
STARTUP_APPLICATION_NAME = "pglock-celery-startup"


def where_locks_live(config: PglockConfig) -> list[tuple[str, str]]:
    """Each lock database of ``config``: (how to name it in a log line, its DSN)."""
    found = []
    for name, shard in config.each_shard():
        dsn = shard.require_dsn()
        described = f"{describe_target(dsn)}, strategy {shard.strategy}"
        if shard.patroni_url:
            members = ", ".join(_without_userinfo(url) for url in shard.patroni_url)
            described += f", fenced by Patroni ({members})"
        found.append((described if name == DEFAULT else f"shard {name!r}: {described}", dsn))
    return found


def _without_userinfo(url: str) -> str:
    parts = urllib.parse.urlsplit(url)
    host = parts.hostname or ""
    netloc = f"[{host}]" if ":" in host else host
    if parts.port is not None:
        netloc += f":{parts.port}"
    return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, "", ""))


def check_reachable(dsn: str, described: str, connect_timeout: float) -> None:
    """Warn when the lock database ``dsn`` cannot be reached now."""
    try:
        # libpq counts whole seconds and treats anything below 2 as 2.
        timeout = max(2, round(connect_timeout))
        with psycopg.connect(
            dsn, connect_timeout=timeout, application_name=STARTUP_APPLICATION_NAME
        ):
            pass
    except psycopg.Error as exc:
        logger.warning(
            "pglock-celery: the lock database %s cannot be reached: %s; every locked task "
            "there fails closed until it can",
            described,
            redact(" ".join(str(exc).split()), dsn),
        )


def announce(app: Celery) -> list[threading.Thread]:
    """Log where ``app``'s locks live and start the reachability checks; their threads."""
    try:
        config = get_config(app)
        databases = where_locks_live(config)
    except ConfigurationError:
        return []  # a worker with such settings does not start (task._refuse_to_start)
    checks = []
    for described, dsn in databases:
        logger.info("pglock-celery: locks on %s", described)
        check = threading.Thread(
            target=check_reachable,
            args=(dsn, described, config.connect_timeout),
            name="pglock-startup-check",
            daemon=True,
        )
        check.start()
        checks.append(check)
    return checks
