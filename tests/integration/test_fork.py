"""A forked child of a holder (os.fork, as multiprocessing's fork does) never touches its lock.

The child neither frees, writes through, nor keeps alive its parent's lock session: a
child leaving its ``with`` block or exiting leaves the parent's hold, a handle the child
inherited cannot write, and a holder that dies frees its lock though its children live on.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from functools import partial

import psycopg
import pytest

from pglock_celery import LockLost
from pglock_celery.sources import registry
from tests.support.locks import free_elsewhere, lock
from tests.support.services import wait_until
from tests.support.workers import ROOT

pytestmark = pytest.mark.usefixtures("empty_cache")  # no idle session across tests


shared_lock = partial(lock, strategy="shared", check_interval=0.2)


@pytest.fixture
def table(pg_dsn: str) -> Iterator[str]:
    name = f"fork_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(f"CREATE TABLE {name} (who text)")
    yield name
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(f"DROP TABLE {name}")


def _reap(pid: int) -> int:
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


# --- a child's copy of its parent's session and handles ------------------------------------


def test_a_forked_child_does_not_use_its_parents_sessions(pg_dsn: str, run_id: str) -> None:
    with lock(pg_dsn, f"a:{run_id}") as first:
        backend = first.connection.info.backend_pid
    assert registry.idle_count() == 1
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: reports what it sees, then leaves without cleanup
        os.close(read)
        os.write(write, str(registry.idle_count()).encode())
        os._exit(0)
    os.close(write)
    seen = os.read(read, 16).decode()
    os.close(read)
    os.waitpid(pid, 0)
    assert seen == "0"
    # The parent's very session survived the child's exit (not a replacement).
    with lock(pg_dsn, f"b:{run_id}") as again:
        assert again.held()
        assert again.connection.info.backend_pid == backend


def test_what_a_forked_child_does_with_its_parents_sessions(pg_dsn: str, run_id: str) -> None:
    """The child's hook, run here as a child runs it: copies closed, handles dead, none kept.

    This process owns the sockets alone, so closing them frees the lock on the server:
    proof that the hook closed them (in a real child, the parent's copies keep them open).
    """
    with lock(pg_dsn, f"warm:{run_id}"):
        pass
    held = lock(pg_dsn, f"a:{run_id}")
    assert held.acquire()
    cursor = held.connection.cursor()
    registry._after_fork_in_child()
    assert registry.idle_count() == 0 and registry.shared_count() == 0
    with pytest.raises(
        psycopg.OperationalError, match=r"^this lock connection belongs to the parent process$"
    ):
        cursor.execute("SELECT 1")
    wait_until(
        lambda: free_elsewhere(pg_dsn, f"a:{run_id}"), 5, "the server to see the closed socket"
    )
    with pytest.raises(LockLost):
        held.release()


def test_a_forked_childs_copy_of_lock_connection_cannot_write(
    pg_dsn: str, run_id: str, table: str
) -> None:
    """A handle inherited by a forked child never commits, even once its fd number is reused."""
    holder = lock(pg_dsn, f"fork:{run_id}")
    assert holder.acquire()
    conn = holder.connection  # e.g. captured by a closure the child runs
    fd = conn.pgconn.socket
    go_r, go_w = os.pipe()
    out_r, out_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: waits until the parent released, then writes
        code = 0
        try:
            os.read(go_r, 1)
            own = []  # the child's own connections, as good practice after a fork wants
            for _ in range(20):
                own.append(psycopg.connect(pg_dsn, autocommit=True))
                if own[-1].pgconn.socket == fd:
                    break
            try:
                conn.execute(f"INSERT INTO {table} VALUES ('the child, through lock.connection')")
                os.write(out_w, b"committed")
            except psycopg.Error as exc:
                os.write(out_w, f"refused: {exc}".encode()[:200])
        except BaseException:
            code = 1
        os._exit(code)
    os.close(go_r)
    os.close(out_w)
    holder.release()  # the parent is done; another replica takes the tenant
    with psycopg.connect(pg_dsn, autocommit=True) as other:
        other.execute("SELECT pg_advisory_lock(%s::int8)", (holder.key,))
        os.write(go_w, b"x")
        assert _reap(pid) == 0
        said = os.read(out_r, 300).decode()
        rows = other.execute(f"SELECT who FROM {table}").fetchall()
    os.close(go_w)
    os.close(out_r)
    assert rows == [], f"the child {said} a write while another session held the lock: {rows}"


def test_a_child_leaving_the_with_block_leaves_the_parents_lock(pg_dsn: str, run_id: str) -> None:
    """A forked child running off the end of `with lock:` frees nothing of its parent's."""
    holder = lock(pg_dsn, f"forkwith:{run_id}")
    with holder:
        conn = holder.connection
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                holder.release()  # what the child's exit from the with-block does
                code = 3 if holder.acquired else 0
            except BaseException:
                code = 1
            os._exit(code)
        assert _reap(pid) == 0
        assert holder.held()
        assert not free_elsewhere(pg_dsn, holder.key)
        assert conn.execute("SELECT 1").fetchone() == (1,)


def test_a_child_exiting_normally_leaves_the_parents_hold(pg_dsn: str, run_id: str) -> None:
    """A forked child that exits normally (atexit, finalizers) keeps the parent's hold."""
    code = (
        "import os, sys\n"
        "from pglock_celery.config import PglockConfig\n"
        "from pglock_celery.lock import AdvisoryLock\n"
        "lock = AdvisoryLock(sys.argv[2], config=PglockConfig(dsn=sys.argv[1]))\n"
        "assert lock.acquire()\n"
        "conn = lock.connection\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    sys.exit(0)\n"
        "os.waitpid(pid, 0)\n"
        "print(lock.held(), conn.execute('SELECT 1').fetchone() == (1,), flush=True)\n"
        "lock.release()\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, pg_dsn, f"forkexit:{run_id}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout
    assert out.split() == ["True", "True"]


FORK_RIGHT_AFTER_A_LOCK = """
import os, sys
from pglock_celery.config import PglockConfig
from pglock_celery.lock import AdvisoryLock
config = PglockConfig(dsn=sys.argv[1], check_interval=0.05)
held = AdvisoryLock("t:" + sys.argv[2], config=config)
held.acquire()
child = os.fork()
if child == 0:
    held.release()  # a child unwinding: sends nothing on its parent's session
    with AdvisoryLock("c:" + sys.argv[2], config=config) as mine:
        assert mine.acquired
    os._exit(0)
_, status = os.waitpid(child, 0)
print(status, held.held(), flush=True)
held.release()
"""


def test_a_child_forked_right_after_a_lock_neither_hangs_nor_touches_the_parents_session(
    pg_dsn: str, run_id: str
) -> None:
    for round_ in range(4):
        done = subprocess.run(
            [sys.executable, "-c", FORK_RIGHT_AFTER_A_LOCK, pg_dsn, f"{run_id}-{round_}"],
            capture_output=True, text=True, timeout=30, cwd=ROOT,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert done.stdout.split() == ["0", "True"], done.stderr


def test_a_child_forked_during_a_statement_on_the_shared_session_can_leave_its_with_block(
    pg_dsn: str, run_id: str
) -> None:
    """A child forked while another thread's statement holds the shared session (its
    guard) can release its copy of a lock on that session: it never waits for the guard."""
    first = shared_lock(pg_dsn, f"f:{run_id}:a", shared_sessions=1)
    second = shared_lock(pg_dsn, f"f:{run_id}:b", shared_sessions=1)
    assert first.acquire() and second.acquire()
    inside, leave = threading.Event(), threading.Event()
    session = second._hold.session  # type: ignore[union-attr]

    def in_a_statement() -> None:
        with session.guard:  # as a statement of the library's holds it, for as long
            inside.set()
            leave.wait(30)

    thread = threading.Thread(target=in_a_statement)
    thread.start()
    try:
        assert inside.wait(10)
        pid = os.fork()
        if pid == 0:  # the child: leave the with block it inherited
            try:
                first.release()
            except BaseException as exc:
                print("child release raised", repr(exc), file=sys.stderr, flush=True)
            finally:
                os._exit(0)
        deadline = time.monotonic() + 5
        exited = False
        while time.monotonic() < deadline:
            done, _ = os.waitpid(pid, os.WNOHANG)
            if done:
                exited = True
                break
            time.sleep(0.05)
        else:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        assert exited, "the child hung in release() on the session guard a parent thread held"
    finally:
        leave.set()
        thread.join(10)
        second.release()
        first.release()


# --- G2 with forks: a holder that dies frees its lock, whatever its children do -----------


def test_a_holder_that_dies_frees_its_lock_although_it_forked_while_connecting(
    pg_dsn: str, run_id: str
) -> None:
    """G2 with a fork during the lock session's connect: the child keeps no copy of its socket."""
    name = f"forkconn:{run_id}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.support.fork_during_connect", pg_dsn, name],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    children: list[int] = []
    try:
        out, _ = proc.communicate(timeout=30)
        lines = out.splitlines()
        children = [int(pid) for pid in lines[0].split()]
        assert lines[1] == "held"
        key = lock(pg_dsn, name).key
        deadline = time.monotonic() + 3
        while not free_elsewhere(pg_dsn, key) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert free_elsewhere(pg_dsn, key), (
            f"the holder died 3 s ago, its {len(children)} forked children live on, "
            "and the lock is still held"
        )
    finally:
        for child in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_dead_holder_is_not_kept_alive_by_a_child_forked_while_it_held(
    pg_dsn: str, run_id: str
) -> None:
    """Holder forks a long-lived child while holding, then dies: the lock is freed."""
    name = f"forkdie:{run_id}"
    code = (
        "import os, sys, time, signal\n"
        "from pglock_celery.config import PglockConfig\n"
        "from pglock_celery.lock import AdvisoryLock\n"
        "lock = AdvisoryLock(sys.argv[2], config=PglockConfig(dsn=sys.argv[1]))\n"
        "assert lock.acquire()\n"
        "lock.connection.execute('SELECT 1')\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    os.close(1); time.sleep(30); os._exit(0)\n"
        "print(pid, flush=True)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code, pg_dsn, name], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    child = 0
    try:
        out, _ = proc.communicate(timeout=30)
        child = int(out.split()[0])
        key = lock(pg_dsn, name).key
        deadline = time.monotonic() + 3
        while not free_elsewhere(pg_dsn, key) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert free_elsewhere(pg_dsn, key)
    finally:
        if child:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)


FORK_KEEPS_NOTHING = """
import os, signal, sys, time
from pglock_celery.config import PglockConfig
from pglock_celery.lock import AdvisoryLock
config = PglockConfig(dsn=sys.argv[1])
with AdvisoryLock("warm:" + sys.argv[2], config=config):
    pass  # an idle session is cached now
child = os.fork()
if child == 0:
    time.sleep(60)
    os._exit(0)
held = AdvisoryLock("t:" + sys.argv[2], config=config)
held.acquire()
print(child, held.connection.info.backend_pid, flush=True)
time.sleep(60)
"""


def test_a_fork_never_keeps_a_killed_holders_lock_alive(pg_dsn: str, run_id: str) -> None:
    process = subprocess.Popen(
        [sys.executable, "-c", FORK_KEEPS_NOTHING, pg_dsn, run_id],
        stdout=subprocess.PIPE, text=True, cwd=ROOT,
    )  # fmt: skip
    assert process.stdout is not None
    child, _ = (int(field) for field in process.stdout.readline().split())
    try:
        assert not free_elsewhere(pg_dsn, f"t:{run_id}")
        process.kill()
        process.wait(10)
        start = time.monotonic()
        wait_until(lambda: free_elsewhere(pg_dsn, f"t:{run_id}"), 1.0, "the lock to come free")
        print(f"\nfree {1000 * (time.monotonic() - start):.0f} ms after the kill, child alive")
        os.kill(child, 0)  # the child still lives: it did not keep the lock
    finally:
        with __import__("contextlib").suppress(ProcessLookupError):
            os.kill(child, 9)
        process.kill()
        process.stdout.close()
