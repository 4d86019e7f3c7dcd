"""A real PgBouncer in front of the test server, in the pool mode a test asks for."""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import psycopg

from .ci import missing
from .services import free_port, stop_process, wait_until


def _has_user(name: str) -> bool:
    try:
        pwd.getpwnam(name)
        return True
    except KeyError:
        return False


def binary() -> str:
    """The pgbouncer program; without it the test fails in CI and is skipped elsewhere."""
    found = shutil.which("pgbouncer") or "/usr/sbin/pgbouncer"
    if not Path(found).exists():
        missing("pgbouncer is not installed (make test installs it from Debian's packages)")
    return found


@contextlib.contextmanager
def pgbouncer(
    pg_dsn: str,
    tmp_path: Path,
    *,
    mode: str,
    pool_size: int = 4,
    ignore_options: bool = False,
    reset_query: str | None = None,
) -> Iterator[str]:
    """Run PgBouncer (``mode``: session or transaction) and yield a DSN through it.

    ``pool_size`` server sessions at most per database and user (1: every client
    shares one backend). ``ignore_options`` sets ``ignore_startup_parameters =
    options``, a common setting that makes PgBouncer drop the client's startup options
    silently. ``reset_query`` sets ``server_reset_query`` (PgBouncer's default: DISCARD
    ALL; ``""`` turns the reset off). PgBouncer refuses to run as root: then it runs as
    postgres (or nobody). It is stopped by pid.
    """
    program = binary()
    params = psycopg.conninfo.conninfo_to_dict(pg_dsn)
    port = free_port()
    (tmp_path / "users.txt").write_text(f'"{params.get("user", "postgres")}" ""\n')
    extra = "ignore_startup_parameters = options\n" if ignore_options else ""
    if reset_query is not None:
        extra += f"server_reset_query = {reset_query}\n"
    (tmp_path / "pgbouncer.ini").write_text(
        "[databases]\n"
        f"* = host={params.get('host', '127.0.0.1')} port={params.get('port', 5432)}\n"
        "[pgbouncer]\n"
        f"listen_addr = 127.0.0.1\nlisten_port = {port}\nunix_socket_dir =\n"
        f"auth_type = trust\nauth_file = {tmp_path / 'users.txt'}\n"
        f"pool_mode = {mode}\ndefault_pool_size = {pool_size}\n{extra}"
    )
    tmp_path.chmod(0o755)
    command = [program, str(tmp_path / "pgbouncer.ini")]
    if os.geteuid() == 0:
        command[1:1] = ["-u", "postgres" if _has_user("postgres") else "nobody"]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    # Clients reach PgBouncer where it listens, whichever way it reaches the server (a
    # ``pg_dsn`` over a Unix socket makes PgBouncer use that socket).
    client = {k: v for k, v in params.items() if k != "hostaddr"}
    dsn = psycopg.conninfo.make_conninfo(**{**client, "host": "127.0.0.1", "port": str(port)})  # type: ignore[arg-type]

    def answers() -> bool:
        if process.poll() is not None:
            raise AssertionError(f"pgbouncer exited: {process.stderr.read()!r}")  # type: ignore[union-attr]
        try:
            with psycopg.connect(dsn, connect_timeout=2, prepare_threshold=None):
                return True
        except psycopg.Error:
            return False

    try:
        wait_until(answers, 20, "pgbouncer")
        yield dsn
    finally:
        stop_process(process, 10)
        process.stderr.close()  # type: ignore[union-attr]
