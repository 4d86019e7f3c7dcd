"""Adversarial: forked children of a holder (os.fork, as multiprocessing's fork does)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psycopg
import pytest

from pglock_celery.sources import registry
from tests.adversary_helpers import make_lock, taken_elsewhere

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def empty_cache() -> None:
    registry.close()


@pytest.fixture
def table(pg_dsn: str) -> object:
    name = f"adv_fork_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(f"CREATE TABLE {name} (who text)")
    yield name
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(f"DROP TABLE {name}")


def _reap(pid: int) -> int:
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def test_a_forked_childs_copy_of_lock_connection_cannot_write(
    pg_dsn: str, run_id: str, table: str
) -> None:
    """A handle inherited by a forked child never commits, even once its fd number is reused."""
    lock = make_lock(pg_dsn, f"adv:fork:{run_id}")
    assert lock.acquire()
    conn = lock.connection  # e.g. captured by a closure the child runs
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
    lock.release()  # the parent is done; another replica takes the tenant
    with psycopg.connect(pg_dsn, autocommit=True) as other:
        other.execute("SELECT pg_advisory_lock(%s::int8)", (lock.key,))
        os.write(go_w, b"x")
        assert _reap(pid) == 0
        said = os.read(out_r, 300).decode()
        rows = other.execute(f"SELECT who FROM {table}").fetchall()
    os.close(go_w)
    os.close(out_r)
    assert rows == [], f"the child {said} a write while another session held the lock: {rows}"


def test_a_holder_that_dies_frees_its_lock_although_it_forked_while_connecting(
    pg_dsn: str, run_id: str
) -> None:
    """G2 with a fork during the lock session's connect: the child keeps no copy of its socket."""
    name = f"adv:forkconn:{run_id}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.adversary_helpers.fork_during_connect", pg_dsn, name],
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
        key = make_lock(pg_dsn, name).key
        deadline = time.monotonic() + 3
        while not taken_elsewhere(pg_dsn, key) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert taken_elsewhere(pg_dsn, key), (
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


# --- probes that pass: kept as regression tests ---------------------------------------


def test_a_child_leaving_the_with_block_leaves_the_parents_lock(pg_dsn: str, run_id: str) -> None:
    """Probe: a forked child running off the end of `with lock:` frees nothing of its parent's."""
    lock = make_lock(pg_dsn, f"adv:forkwith:{run_id}")
    with lock:
        conn = lock.connection
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                lock.release()  # what the child's exit from the with-block does
                code = 3 if lock.acquired else 0
            except BaseException:
                code = 1
            os._exit(code)
        assert _reap(pid) == 0
        assert lock.held()
        assert not taken_elsewhere(pg_dsn, lock.key)
        assert conn.execute("SELECT 1").fetchone() == (1,)


def test_a_dead_holder_is_not_kept_alive_by_a_child_forked_while_it_held(
    pg_dsn: str, run_id: str
) -> None:
    """Probe: holder forks a long-lived child while holding, then dies: the lock is freed."""
    name = f"adv:forkdie:{run_id}"
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
        key = make_lock(pg_dsn, name).key
        deadline = time.monotonic() + 3
        while not taken_elsewhere(pg_dsn, key) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert taken_elsewhere(pg_dsn, key)
    finally:
        if child:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)


def test_a_child_exiting_normally_leaves_the_parents_hold(pg_dsn: str, run_id: str) -> None:
    """Probe: a forked child that exits normally (atexit, finalizers) keeps the parent's hold."""
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
        [sys.executable, "-c", code, pg_dsn, f"adv:forkexit:{run_id}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout
    assert out.split() == ["True", "True"]
