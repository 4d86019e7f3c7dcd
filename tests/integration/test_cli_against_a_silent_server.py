"""The CLI against a server that stops answering after the connect: one line, exit 2, bounded.

The server's backend of the command's session is stopped (SIGSTOP) while that session
waits in a statement: its kernel still acknowledges every packet, so no keepalive or
tcp_user_timeout ever fires, and only the client's own deadline ends the wait. The
statement is held at the right moment by a lock on the ``pg_locks`` view (both
commands read it), taken by the test on a throwaway server of its own.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import psycopg
import pytest

from pglock_celery.operator_session import OPERATOR_DEADLINE
from tests.support.services import EmbeddedPostgres, wait_until

#: What docs/cli.md promises: a statement's deadline, and a margin for the
#: interpreter's start and the connect (a few seconds on a loaded machine).
BOUND = OPERATOR_DEADLINE + 10


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedPostgres]:
    server = EmbeddedPostgres(tmp_path_factory.mktemp("silent"))
    server.init()
    server.start()
    yield server
    server.destroy()


def _waiting_backend(dsn: str, application_name: str) -> int | None:
    """The pid of a backend of ``application_name`` waiting on a lock (pg_stat_activity
    itself would wait behind the test's lock: its function is asked instead)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT pid FROM pg_catalog.pg_stat_get_activity(NULL) AS a"
            " WHERE a.application_name = %s AND a.wait_event_type = 'Lock'",
            (application_name,),
        ).fetchone()
    return None if row is None else int(row[0])


@pytest.mark.parametrize(
    ("command", "application_name"),
    [("locks", "pglock-celery-cli"), ("doctor", "pglock-doctor-probe")],
)
def test_a_server_that_stops_answering_ends_the_command_with_one_line_and_exit_2(
    server: EmbeddedPostgres, command: str, application_name: str
) -> None:
    """(doctor's main session is the one its pooler check renames pglock-doctor-probe.)"""
    dsn = server.dsn
    blocker = psycopg.connect(dsn)
    blocker.execute("LOCK TABLE pg_catalog.pg_locks IN ACCESS EXCLUSIVE MODE")
    started = time.monotonic()
    run = subprocess.Popen(
        [sys.executable, "-m", "pglock_celery.cli", command, "--dsn", dsn],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    stopped: int | None = None
    try:
        backend = wait_until(
            lambda: _waiting_backend(dsn, application_name),
            30,
            f"the {command} session to wait in its statement",
        )
        os.kill(backend, signal.SIGSTOP)
        stopped = backend
        frozen_at = time.monotonic()
        blocker.rollback()  # the backend would go on now, but it is stopped: silent
        try:
            out, err = run.communicate(timeout=BOUND + 30)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{command} still waits {BOUND + 30:g} s after its server went silent")
        took = time.monotonic() - frozen_at
    finally:
        if stopped is not None:
            os.kill(stopped, signal.SIGCONT)
        if run.poll() is None:
            run.kill()
        run.communicate()  # reaped, its pipes closed
        blocker.close()
    print(f"\n{command}: ended {took:.1f} s after the server went silent ({err.strip()})")
    assert run.returncode == 2, out + err
    assert len(err.strip().splitlines()) == 1, err
    assert "Traceback" not in err
    assert "stopped answering" in err and f"127.0.0.1:{server.port}" in err
    assert took < BOUND
    assert time.monotonic() - started < BOUND + 30
