"""The tests' services: PGLOCK_TEST_DSN / PGLOCK_TEST_BROKER, else local, else embedded.

A run keeps to itself on a shared server: it works in a Postgres database of its
own (advisory locks, pg_locks and pg_stat_activity counts are scoped by
database) and a Redis database of its own, so that a `make run`, a bench or a
second `make test` on the same servers neither disturbs it nor is disturbed by it.
Embedded servers take ports outside the kernel's ephemeral range.
"""

from __future__ import annotations

import contextlib
import os
import random
import socket
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import psycopg
import redis
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from tasks import services
from tasks.services import LOCAL_BROKER, postgres_answers, stop_process, wait_until

LOCAL_TEST_DSN = "host=127.0.0.1 port=5432 user=postgres dbname=test"

__all__ = [
    "EmbeddedPostgres",
    "EmbeddedRedis",
    "free_port",
    "over_unix_socket",
    "own_database",
    "own_redis_database",
    "postgres_answers",
    "postgres_for_tests",
    "redis_for_tests",
    "scalar",
    "stop_process",
    "wait_until",
]

#: Where this machine's test processes record the ports they took (see free_port).
PORT_CLAIMS = Path("/tmp/pglock-test-ports")
_taken: set[int] = set()
_taken_guard = threading.Lock()


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("", port))  # every address: 127.0.0.1 and a namespace's veth alike
        except OSError:
            return False
    return True


def _claim(port: int) -> bool:
    """Record ``port`` as this process's; False if a live test process has it."""
    PORT_CLAIMS.mkdir(mode=0o777, exist_ok=True)
    path = PORT_CLAIMS / str(port)
    for _ in range(2):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            try:
                owner = int(path.read_text() or "0")
                os.kill(owner, 0)
                return owner == os.getpid()
            except (ProcessLookupError, ValueError):
                path.unlink(missing_ok=True)  # its process is gone: a stale claim
                continue
            except (PermissionError, OSError):
                return False
        with os.fdopen(fd, "w") as claim:
            claim.write(str(os.getpid()))
        return True
    return False


def free_port() -> int:
    """Return a TCP port that nothing on this machine uses, for a server a test starts.

    bind(0) hands out a port of the ephemeral range, which any process's outgoing
    connection (and another run's bind(0)) may take between our check and the
    server's bind. A port outside that range is only taken by a deliberate bind,
    and a claim file keeps this machine's test processes from picking the same one.
    """
    low, high = _ephemeral_range()
    candidates = [p for p in range(20000, 32768) if not low <= p <= high] or list(range(1024, low))
    rng = random.Random()
    for _ in range(200):
        port = rng.choice(candidates)
        with _taken_guard:
            if port in _taken:
                continue
            if _bindable(port) and _claim(port):
                _taken.add(port)
                return port
    raise RuntimeError("no free TCP port found outside the ephemeral range")


class EmbeddedPostgres(services.EmbeddedPostgres):
    """A throwaway Postgres cluster on a port from :func:`free_port`."""

    def __init__(self, base: Path, port: int | None = None) -> None:
        super().__init__(base, port or free_port())

    def standby(self, base: Path) -> services.EmbeddedPostgres:
        replica = super().standby(base)
        replica.port = free_port()
        with (replica.data / "postgresql.conf").open("a") as conf:
            conf.write(f"port = {replica.port}\n")  # the last setting wins
        return replica


class EmbeddedRedis(services.EmbeddedRedis):
    """A throwaway redis-server on a port from :func:`free_port`."""

    def __init__(self, base: Path, port: int | None = None) -> None:
        super().__init__(base, port or free_port())


def postgres_for_tests(base: Path) -> contextlib.AbstractContextManager[str]:
    """The DSN of a server: PGLOCK_TEST_DSN, else the local one, else an embedded one."""
    return services.postgres_service(base, "PGLOCK_TEST_DSN", LOCAL_TEST_DSN, EmbeddedPostgres)


def redis_for_tests(base: Path) -> contextlib.AbstractContextManager[str]:
    """The URL of a server: PGLOCK_TEST_BROKER, else the local one, else an embedded one."""
    return services.redis_service(base, "PGLOCK_TEST_BROKER", LOCAL_BROKER, EmbeddedRedis)


def over_unix_socket(dsn: str) -> str:
    """``dsn`` through the server's Unix socket (the first of its socket directories)."""
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT current_setting('unix_socket_directories')").fetchone()
    directory = str(row[0] if row else "").split(",")[0].strip()
    assert directory, "the server listens on no Unix socket"
    params = conninfo_to_dict(dsn)
    params.pop("hostaddr", None)
    return make_conninfo(**{**params, "host": directory})


@contextlib.contextmanager
def own_database(dsn: str) -> Iterator[str]:
    """Create a database of this run's own on ``dsn``'s server; yield its DSN; drop it.

    Without the right to create databases, ``dsn``'s own database is used as it is.
    """
    name = f"pglock_run_{uuid.uuid4().hex[:12]}"
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    except psycopg.errors.InsufficientPrivilege:
        yield dsn
        return
    try:
        yield make_conninfo(dsn, dbname=name)
    finally:
        with psycopg.connect(dsn, autocommit=True) as conn:
            # FORCE: a session a crashed worker left behind must not keep it.
            conn.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )


#: Redis databases a run may claim; 0 is left to `make run`.
RUN_DATABASES = range(1, 16)
#: Held by the run that uses a database, with a TTL it renews while it lives.
CLAIM_KEY = "pglock-tests:claim"
#: Marks a database a test run used: its leftovers may be cleared by the next run.
MARK_KEY = "pglock-tests:used"
CLAIM_TTL = 120


def _with_db(url: str, db: int) -> str:
    parts = urlsplit(url)
    return urlunsplit(parts._replace(path=f"/{db}"))


@contextlib.contextmanager
def own_redis_database(url: str) -> Iterator[str]:
    """Claim a Redis database of this run's own on ``url``'s server; yield its URL.

    A database is taken when it is empty or only a test run used it, and no live
    run holds its claim (a key with a TTL this run renews; a crashed run's lapses).
    Its keys are cleared when the run ends.
    """
    me = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
    client: redis.Redis | None = None
    for db in RUN_DATABASES:
        candidate = redis.Redis.from_url(_with_db(url, db))
        if not candidate.set(CLAIM_KEY, me, nx=True, ex=CLAIM_TTL):
            candidate.close()
            continue
        if candidate.dbsize() == 1 or candidate.exists(MARK_KEY):
            client = candidate
            break
        candidate.delete(CLAIM_KEY)  # someone else's data: not ours to use
        candidate.close()
    if client is None:
        raise RuntimeError(f"no Redis database free for this run on {url} (tried 1 to 15)")
    _clear(client, keep=CLAIM_KEY)
    client.set(MARK_KEY, me)
    stop = threading.Event()

    def renew() -> None:
        while not stop.wait(CLAIM_TTL / 4):
            with contextlib.suppress(redis.RedisError):
                client.expire(CLAIM_KEY, CLAIM_TTL)

    renewer = threading.Thread(target=renew, name="redis-claim", daemon=True)
    renewer.start()
    try:
        yield _with_db(url, client.connection_pool.connection_kwargs["db"])
    finally:
        stop.set()
        renewer.join()
        with contextlib.suppress(redis.RedisError):
            if client.get(CLAIM_KEY) == me.encode():
                _clear(client, keep=MARK_KEY)
                client.delete(CLAIM_KEY)
        client.close()


def _clear(client: redis.Redis, keep: str) -> None:
    for key in client.scan_iter(count=500):
        if key != keep.encode():
            client.delete(key)


def scalar(dsn: str, query: str, params: tuple[Any, ...] = ()) -> Any:
    """The first value of ``query``'s first row (None without one), in a session of its own."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        cursor = conn.execute(query, params)
        row = cursor.fetchone() if cursor.description else None
    return row[0] if row else None
