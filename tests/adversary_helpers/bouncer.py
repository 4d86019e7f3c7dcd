"""A PgBouncer of the test's own, in front of the test Postgres, on a free port."""

from __future__ import annotations

import contextlib
import os
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from tests.helpers.services import free_port

PGBOUNCER = "/usr/sbin/pgbouncer"


@contextlib.contextmanager
def pgbouncer(dsn: str, pool_mode: str, pool_size: int = 1) -> Iterator[str]:
    """Run PgBouncer in ``pool_mode``; yield a DSN through it; stop it (by pid) after.

    PgBouncer refuses to run as root: then it runs as ``nobody`` (``-u``), in a
    directory of its own that user can write.
    """
    workdir = Path(tempfile.mkdtemp(prefix="adv-pgbouncer-"))
    os.chmod(workdir, 0o777)
    params = conninfo_to_dict(dsn)
    port = free_port()
    user = str(params.get("user") or "postgres")
    dbname = str(params.get("dbname") or user)
    (workdir / "users.txt").write_text(f'"{user}" ""\n')
    (workdir / "pgbouncer.ini").write_text(
        f"""[databases]
{dbname} = host={params.get("host", "127.0.0.1")} port={params.get("port", 5432)} dbname={dbname}

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = {port}
unix_socket_dir =
auth_type = trust
auth_file = {workdir / "users.txt"}
pool_mode = {pool_mode}
default_pool_size = {pool_size}
max_client_conn = 50
ignore_startup_parameters = options,extra_float_digits
logfile = {workdir / "pgbouncer.log"}
pidfile =
"""
    )
    as_user = ["-u", "nobody"] if os.geteuid() == 0 else []
    proc = subprocess.Popen(
        [PGBOUNCER, *as_user, str(workdir / "pgbouncer.ini")],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    through = make_conninfo(dsn, host="127.0.0.1", port=port)
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                with psycopg.connect(through, autocommit=True, connect_timeout=2):
                    break
            except psycopg.OperationalError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise
                time.sleep(0.1)
        yield through
    finally:
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        for leftover in workdir.iterdir():
            leftover.unlink()
        workdir.rmdir()
