"""The lock session against a hostile server.

Crash restarts, a role's settings and search_path, thread and memory bounds.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from pglock_celery import LockLost, LockTimeout, LockUnavailable, lock_key
from pglock_celery.config import PglockConfig
from pglock_celery.session import open_session
from pglock_celery.sources import registry
from tests.support.locks import DEDICATED, STRATEGIES, free_elsewhere, lock
from tests.support.services import over_unix_socket, wait_until

pytestmark = pytest.mark.usefixtures("empty_cache")  # no idle session across tests


ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def own_server(server_of_its_own: Callable[..., str]) -> str:
    """A server of this test's own (a crash restart resets every session on it)."""
    return server_of_its_own()


def crash_restart(dsn: str) -> None:
    """SIGKILL a backend, as the OOM killer does: the postmaster resets every session."""
    victim = psycopg.connect(dsn, autocommit=True)
    pid = victim.info.backend_pid
    os.kill(pid, signal.SIGKILL)
    victim.close()


def answers(dsn: str) -> bool:
    try:
        with psycopg.connect(dsn, connect_timeout=2) as conn:
            conn.execute("SELECT 1")
        return True
    except psycopg.Error:
        return False


@pytest.mark.parametrize("strategy", DEDICATED)
def test_a_crash_restart_inside_the_holders_transaction_is_a_lost_lock(
    own_server: str, run_id: str, strategy: str
) -> None:
    held = lock(own_server, f"crash:{run_id}", strategy=strategy, check_interval=0.2)
    assert held.acquire()
    with pytest.raises(LockLost), held.transaction() as conn:
        conn.execute("SELECT 1")
        crash_restart(own_server)
        wait_until(lambda: not held.held(), 5, "held() to see the crash restart")
        with pytest.raises(LockLost):
            held.ensure_held()
        conn.execute("SELECT 2")
    with pytest.raises(LockLost):
        held.release()
    wait_until(lambda: answers(own_server), 30, "the server to come back")


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_crash_restart_during_a_short_hold_fails_its_release(
    own_server: str, run_id: str, strategy: str
) -> None:
    held = lock(own_server, f"crash:{run_id}", strategy=strategy, check_interval=30)
    assert held.acquire()
    crash_restart(own_server)
    time.sleep(0.2)  # the goodbye travels; nothing of the library is asked meanwhile
    with pytest.raises(LockLost):
        held.release()
    wait_until(lambda: answers(own_server), 30, "the server to come back")


def test_the_monitor_reports_a_crash_restart_of_a_hold_inside_its_transaction(
    own_server: str, run_id: str
) -> None:
    held = lock(own_server, f"crash:{run_id}", check_interval=0.2)
    assert held.acquire()
    conn = held.connection
    conn.execute("BEGIN")
    crash_restart(own_server)
    wait_until(lambda: held.lost_reason is not None, 5, "the monitor to report the loss")
    with pytest.raises(LockLost):
        held.release()
    wait_until(lambda: answers(own_server), 30, "the server to come back")


def test_a_holder_learns_its_loss_when_a_killed_postmasters_backend_grants_its_name(
    own_server: str, run_id: str
) -> None:
    """SIGKILL the postmaster itself: its backends serve on until they notice.

    The holder's idle backend exits at once and frees the name; a backend busy in a
    statement, with a try queued behind it, is granted that name before it notices.
    That is Postgres's doing, and the one way two callers can each believe they hold a
    name: the library's part is that the holder learns it within the detection bound
    (G11; a task's body is interrupted then, a plain lock's fails at its next use).
    """
    name = f"orphan:{run_id}"
    held = lock(own_server, name, check_interval=0.2)
    bound = held.config.client_bound
    busy = psycopg.connect(own_server, autocommit=True)
    granted: list[object] = []

    def busy_then_try() -> None:
        try:
            with busy.pipeline():
                busy.execute("SELECT count(*) FROM generate_series(1, 5000000)")
                cur = busy.execute("SELECT pg_try_advisory_lock(%s::int8)", (lock_key(name),))
            granted.append(cur.fetchone())
        except psycopg.Error as exc:
            granted.append(exc)

    assert held.acquire()
    worker = threading.Thread(target=busy_then_try)
    worker.start()
    with psycopg.connect(own_server, autocommit=True) as look:
        wait_until(
            lambda: (
                look.execute(
                    "SELECT state = 'active' FROM pg_stat_activity WHERE pid = %s",
                    (busy.info.backend_pid,),
                ).fetchone()
                == (True,)
            ),
            10,
            "the busy statement to run",
        )
        os.kill(psutil.Process(busy.info.backend_pid).ppid(), signal.SIGKILL)
    killed = time.monotonic()
    wait_until(lambda: held.lost_reason is not None, bound + 5, "the monitor to find the loss")
    told_after = time.monotonic() - killed
    worker.join(30)
    busy.close()
    assert granted == [(True,)], "the surviving backend granted the freed name"
    with pytest.raises(LockLost):
        held.ensure_held()
    assert told_after <= bound, (told_after, bound)


@pytest.mark.parametrize("over", ["tcp", "unix"])
def test_a_cut_shuts_the_sessions_own_socket_and_never_one_that_took_its_number(
    pg_dsn: str, over: str
) -> None:
    """LockSession.cut (a lost lock's statement that may never be answered) checks which
    socket the descriptor's number names (its inode) first: libpq closes the descriptor
    when the server ends the session, and another socket may get its number. Over a
    Unix socket every client socket has the same (empty) address: only the inode tells."""
    config = PglockConfig(dsn=pg_dsn if over == "tcp" else over_unix_socket(pg_dsn))
    session = open_session(config, "pglock|cut")
    stranger, peer = socket.socketpair()
    try:
        fd = session.pgconn.socket
        kept = os.dup(fd)
        os.dup2(stranger.fileno(), fd)  # the number now names another socket
        session.cut()
        peer.sendall(b"x")
        assert os.read(fd, 1) == b"x", "the stranger socket still works"
        os.dup2(kept, fd)  # the session's own socket again
        os.close(kept)
        session.cut()
        with pytest.raises(psycopg.OperationalError):
            session.conn.execute("SELECT 1")
    finally:
        session.close()
        stranger.close()
        peer.close()


def test_a_terminated_wait_fails_at_once_and_waits_nowhere_else(pg_dsn: str, run_id: str) -> None:
    name = f"wait:{run_id}"
    with psycopg.connect(pg_dsn, autocommit=True) as holder:
        holder.execute("SELECT pg_advisory_lock(%s)", (lock_key(name),))
        waiting = lock(pg_dsn, name, wait=True, timeout=6)
        outcome: list[BaseException | bool] = []

        def wait() -> None:
            try:
                outcome.append(waiting.acquire())
            except BaseException as exc:
                outcome.append(exc)

        thread = threading.Thread(target=wait)
        thread.start()
        waiter = wait_until(
            lambda: holder.execute(
                "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
                " AND objid = (%s::int8 & 4294967295)::oid",
                (lock_key(name),),
            ).fetchone(),
            5,
            "the wait to start",
        )
        holder.execute("SELECT pg_terminate_backend(%s)", waiter)
        ended = time.monotonic()
        thread.join(10)
        assert outcome and isinstance(outcome[0], LockUnavailable), outcome
        assert time.monotonic() - ended < 2
        waiters = holder.execute(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
            " AND objid = (%s::int8 & 4294967295)::oid",
            (lock_key(name),),
        ).fetchone()
        assert waiters == (0,)


@pytest.fixture
def role_dsn(pg_dsn: str, run_id: str) -> Iterator[tuple[str, psycopg.Connection]]:
    """A login role of this test's own (settings are set on it by the test)."""
    role = f"pglock_role_{run_id}"
    admin = psycopg.connect(pg_dsn, autocommit=True)
    admin.execute(f"CREATE ROLE {role} LOGIN")
    params = conninfo_to_dict(pg_dsn)
    params["user"] = role
    try:
        yield make_conninfo(**params), admin
    finally:
        registry.close()
        admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s", (role,)
        )
        admin.execute(f"DROP OWNED BY {role}")
        admin.execute(f"DROP ROLE {role}")
        admin.close()


def hold_for(dsn: str, name: str, seconds: float) -> threading.Thread:
    """Hold ``name`` from another session for ``seconds`` (a thread; join it)."""
    taken = threading.Event()

    def hold() -> None:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("SELECT pg_advisory_lock(%s)", (lock_key(name),))
            taken.set()
            time.sleep(seconds)

    thread = threading.Thread(target=hold)
    thread.start()
    assert taken.wait(5)
    return thread


@pytest.mark.parametrize(
    ("setting", "timeout"), [("statement_timeout", 8.0), ("lock_timeout", None)]
)
def test_only_the_callers_timeout_ends_a_wait_whatever_the_roles_bounds(
    role_dsn: tuple[str, psycopg.Connection], run_id: str, setting: str, timeout: float | None
) -> None:
    dsn, admin = role_dsn
    admin.execute(f"ALTER ROLE {conninfo_to_dict(dsn)['user']} SET {setting} = '1s'")
    name = f"bounds:{run_id}"
    holder = hold_for(dsn, name, 2.5)
    started = time.monotonic()
    waited = lock(dsn, name, wait=True, timeout=timeout)
    assert waited.acquire()
    assert time.monotonic() - started >= 2
    waited.release()
    holder.join()
    holder = hold_for(dsn, name, 3)
    with pytest.raises(LockTimeout):
        lock(dsn, name, wait=True, timeout=1.5).acquire()
    holder.join()


def test_a_search_path_cannot_redirect_the_lock_statements(
    pg_dsn: str, role_dsn: tuple[str, psycopg.Connection], run_id: str
) -> None:
    dsn, admin = role_dsn
    role = conninfo_to_dict(dsn)["user"]
    schema = f"impostor_{run_id}"
    admin.execute(f"CREATE SCHEMA {schema} AUTHORIZATION {role}")
    for function in ("pg_try_advisory_lock", "pg_advisory_unlock"):
        admin.execute(
            f"CREATE FUNCTION {schema}.{function}(bigint) RETURNS boolean"
            " LANGUAGE sql AS 'SELECT true'"
        )
    admin.execute(f"ALTER FUNCTION {schema}.pg_try_advisory_lock(bigint) OWNER TO {role}")
    admin.execute(f"ALTER ROLE {role} SET search_path = {schema}, pg_catalog")
    name = f"path:{run_id}"
    for strategy in STRATEGIES:
        first = lock(dsn, name, strategy=strategy)
        second = lock(dsn, name, strategy="connect")
        assert first.acquire()
        assert not second.acquire(), strategy
        assert not free_elsewhere(pg_dsn, name)  # asked by a role without the impostors
        second.release()
        first.release()
        assert free_elsewhere(pg_dsn, name)
    admin.execute(f"DROP SCHEMA {schema} CASCADE")


MONITOR_SURVIVES_A_FAILED_THREAD_START = """
import json, logging, resource, sys, threading, time
import psycopg
from pglock_celery.sources import registry
from tests.support.locks import lock

logging.basicConfig(level=logging.CRITICAL)
dsn, run_id = sys.argv[1], sys.argv[2]
first = lock(dsn, f"starve:{run_id}:1", check_interval=0.2)
threading.stack_size(512 * 1024 * 1024)  # no thread can start under the limit below
soft, hard = resource.getrlimit(resource.RLIMIT_AS)
with open("/proc/self/statm") as statm:
    size = int(statm.read().split()[0]) * resource.getpagesize()
resource.setrlimit(resource.RLIMIT_AS, (size + 256 * 1024 * 1024, hard))
failed_start = False
try:
    threading.Thread(target=lambda: None).start()
except RuntimeError:
    failed_start = True
assert first.acquire()  # its monitor cannot start
time.sleep(0.5)
resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
threading.stack_size(0)
later = lock(dsn, f"starve:{run_id}:2", check_interval=0.2)
assert later.acquire()
with psycopg.connect(dsn, autocommit=True) as admin:
    admin.execute("SELECT pg_terminate_backend(%s)", (later.backend_pid,))
deadline = time.monotonic() + 5
while later.lost_reason is None and time.monotonic() < deadline:
    time.sleep(0.05)
report = {"failed_start": failed_start, "later_lost": later.lost_reason is not None}
first.release()
try:
    later.release()
except Exception:
    pass
registry.close()
print(json.dumps(report))
"""


def test_loss_detection_survives_a_thread_that_could_not_start(pg_dsn: str, run_id: str) -> None:
    done = subprocess.run(
        [sys.executable, "-c", MONITOR_SURVIVES_A_FAILED_THREAD_START, pg_dsn, run_id],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {
        "failed_start": True,
        "later_lost": True,
    }


def test_loss_detection_threads_are_bounded_whatever_the_number_of_holds(
    pg_dsn: str, run_id: str
) -> None:
    before = threading.active_count()
    holds = [
        lock(pg_dsn, f"many:{run_id}:{n}", strategy="shared", check_interval=0.2)
        for n in range(1500)
    ]
    try:
        for held in holds:
            assert held.acquire()
        peak = before
        deadline = time.monotonic() + 2  # several check intervals
        while time.monotonic() < deadline:
            peak = max(peak, threading.active_count())
            time.sleep(0.02)
        assert peak - before <= 1 + 4  # the scheduler and at most four checkers
        assert all(held.lost_reason is None for held in holds)
    finally:
        for held in holds:
            held.release()


MEMORY_AFTER_LONG_NAMES = """
import json, sys
import psutil
from pglock_celery.sources import registry
from tests.support.locks import lock

dsn, run_id = sys.argv[1], sys.argv[2]
with lock(dsn, f"warm:{run_id}"):
    pass
before = psutil.Process().memory_info().rss
for n in range(300):
    name = f"{n}:" + "x" * (1024 * 1024)
    with lock(dsn, name) as held:
        assert held.acquired
    del name, held
after = psutil.Process().memory_info().rss
registry.close()
print(json.dumps({"grown_mib": (after - before) / 2**20}))
"""


def test_what_a_process_keeps_after_releasing_long_names_is_bounded(
    pg_dsn: str, run_id: str
) -> None:
    done = subprocess.run(
        [sys.executable, "-c", MEMORY_AFTER_LONG_NAMES, pg_dsn, run_id],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1])["grown_mib"] < 32
