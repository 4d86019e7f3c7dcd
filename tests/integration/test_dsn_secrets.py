"""A DSN's password never shows: not in errors, results, tracebacks, logs or the CLI.

Each DSN is tried against a port where nothing listens and against a real server that
checks passwords (SCRAM) and refuses this one.
"""

from __future__ import annotations

import os
import subprocess
import sys
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from urllib.parse import quote

import pytest
import redis
from celery import Celery
from psycopg.conninfo import make_conninfo

from pglock_celery import ConfigurationError, LockUnavailable, PglockError, try_lock
from tests.apps import core
from tests.support.services import EmbeddedPostgres
from tests.support.workers import Worker

#: The server's real password; every DSN below carries a wrong one.
SERVER_PASSWORD = "right-Pa55"
#: Two pieces, so that a password that libpq splits is caught piece by piece too.
PIECES = ("Pw9x", "7Zq")
#: The finding's password, and one with every character a DSN gives a meaning to.
SLASHED = "Pw9x/7Zq"
AWKWARD = "Pw9x@: %2F'\"\\ /7Zq"

DsnFor = Callable[[str, int], str]

DSNS: dict[str, tuple[DsnFor, type[PglockError]]] = {
    # libpq mis-splits these (host "postgres", port "Pw9x", ...): refused before connecting.
    "uri-unencoded-slash": (
        lambda host, port: f"postgresql://postgres:{SLASHED}@{host}:{port}/postgres",
        ConfigurationError,
    ),
    "uri-unencoded-at": (
        lambda host, port: f"postgresql://postgres:Pw9x@7Zq@{host}:{port}/postgres",
        ConfigurationError,
    ),
    # These parse cleanly and reach the server (or its closed port).
    "key-value-awkward": (
        lambda host, port: make_conninfo(
            host=host, port=str(port), user="postgres", dbname="postgres", password=AWKWARD
        ),
        LockUnavailable,
    ),
    "uri-percent-encoded-awkward": (
        lambda host, port: (
            f"postgresql://postgres:{quote(AWKWARD, safe='')}@{host}:{port}/postgres"
        ),
        LockUnavailable,
    ),
}


@pytest.fixture(scope="module")
def refusing(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedPostgres]:
    """A throwaway server that wants a password over TCP."""
    server = EmbeddedPostgres(tmp_path_factory.mktemp("refusing"))
    server.init(password=SERVER_PASSWORD)
    server.start()
    yield server
    server.destroy()


def _target(name: str, refusing: EmbeddedPostgres) -> tuple[str, int]:
    return ("127.0.0.1", 1) if name == "unreachable" else ("127.0.0.1", refusing.port)


def assert_no_password(text: str) -> None:
    for secret in (SLASHED, AWKWARD, quote(AWKWARD, safe=""), *PIECES):
        assert secret not in text, f"{secret!r} shows in:\n{text}"


@pytest.mark.parametrize("target", ["unreachable", "refusing"])
@pytest.mark.parametrize("case", list(DSNS))
def test_try_lock_errors_and_their_tracebacks_never_show_the_password(
    case: str, target: str, refusing: EmbeddedPostgres
) -> None:
    dsn_for, expected = DSNS[case]
    dsn = dsn_for(*_target(target, refusing))
    with pytest.raises(PglockError) as raised:
        with try_lock(f"secrets:{case}", dsn=dsn):
            pytest.fail("the body ran without the lock")
    assert type(raised.value) is expected
    message = str(raised.value)
    if expected is LockUnavailable:
        shown = "127.0.0.1:1/postgres" if target == "unreachable" else "password authentication"
        assert shown in message
    # The whole chain, libpq's own exception included, as a worker log would print it.
    assert_no_password(message + "".join(traceback.format_exception(raised.value)))


def test_the_refusing_server_really_checks_the_password(refusing: EmbeddedPostgres) -> None:
    with try_lock("secrets:right", dsn=f"{refusing.dsn} password={SERVER_PASSWORD}") as lock:
        assert lock.acquired


@pytest.mark.parametrize("target", ["unreachable", "refusing"])
@pytest.mark.parametrize("case", list(DSNS))
def test_cli_locks_and_doctor_never_show_the_password(
    case: str, target: str, refusing: EmbeddedPostgres
) -> None:
    dsn_for, expected = DSNS[case]
    dsn = dsn_for(*_target(target, refusing))
    for command in ("locks", "doctor"):
        done = subprocess.run(
            [sys.executable, "-m", "pglock_celery.cli", command, "--dsn", dsn],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert done.returncode == 2, done.stdout + done.stderr
        assert len(done.stderr.strip().splitlines()) == 1, done.stderr
        if expected is ConfigurationError:  # refused before connecting, saying why
            assert "malformed DSN (an '@' after the host part of a URI" in done.stderr
        assert_no_password(done.stdout + done.stderr)


# A DSN that does not parse (the unencoded slash) stops the worker at start instead, its
# text never shown: test_worker_startup.py.
@pytest.fixture(params=["key-value-awkward:refusing"])
def leaky_worker(
    request: pytest.FixtureRequest,
    app: Celery,
    worker_env: dict[str, str],
    log_dir: Path,
    refusing: EmbeddedPostgres,
) -> Iterator[tuple[str, Worker]]:
    """A worker whose PGLOCK_DSN carries a password that must not show."""
    case, target = str(request.param).split(":")
    suffix = f"-{case}"
    env = {
        **worker_env,
        "PGLOCK_DSN": DSNS[case][0](*_target(target, refusing)),
        "PGLOCK_TEST_QUEUE": worker_env["PGLOCK_TEST_QUEUE"] + suffix,
    }
    worker = Worker(app, "tests.apps.core", env, log_dir, concurrency=1)
    yield suffix, worker
    worker.stop()


def test_a_worker_call_shows_the_password_nowhere(
    leaky_worker: tuple[str, Worker], queue: str, broker_url: str, run_id: str
) -> None:
    suffix, worker = leaky_worker
    marker = f"marker:{run_id}"
    call = core.mark.apply_async((run_id, marker), queue=queue + suffix)
    with pytest.raises(PglockError) as raised:
        call.get(timeout=60)
    assert redis.Redis.from_url(broker_url).get(marker) is None  # the body never ran
    assert call.traceback
    worker.stop()  # flush the log
    assert_no_password(str(raised.value))
    assert_no_password(call.traceback)
    log = worker.log.read_text(errors="replace")
    assert_no_password(log)
    assert f"{type(raised.value).__name__}(" in log  # the failure is logged, with its text


def test_the_dsns_above_are_what_the_finding_describes() -> None:
    """The URIs must really be mis-split by libpq, the others parse to the password."""
    from psycopg.conninfo import conninfo_to_dict

    slashed = conninfo_to_dict(DSNS["uri-unencoded-slash"][0]("h", 1))
    assert slashed["port"] == "Pw9x" and "password" not in slashed
    for case in ("key-value-awkward", "uri-percent-encoded-awkward"):
        assert conninfo_to_dict(DSNS[case][0]("h", 1))["password"] == AWKWARD
    assert os.environ.get("PGPASSWORD") is None  # a password from there would hide a leak
