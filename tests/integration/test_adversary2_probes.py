"""Adversary 2, probes that hold: shared locks racing, timing out, failing to open, dropped.

Kept as regression tests; they run before test_adversary2_shared.py (whose tests
leave the process's monitor scheduler asleep for a long tick).
"""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Iterator

import psycopg
import pytest

from pglock_celery import LockTimeout, LockUnavailable, lock_key
from pglock_celery.sources import registry
from tests.helpers.services import wait_until
from tests.integration.test_adversary2_shared import free_elsewhere, lock


@pytest.fixture(autouse=True)
def no_shared_sessions_left() -> Iterator[None]:
    yield
    registry.close()


def test_threads_racing_on_one_name_under_shared_never_hold_it_together(
    pg_dsn: str, run_id: str
) -> None:
    """Probe: 40 threads x 25 tries on one name, 2 shared sessions: never two holders."""
    name = f"race:{run_id}"
    inside = [0]
    peak = [0]
    count_lock = threading.Lock()
    errors: list[BaseException] = []
    start = threading.Barrier(40)

    def worker() -> None:
        try:
            start.wait(10)
            for _ in range(25):
                with lock(pg_dsn, name, shared_sessions=2) as held:
                    if held.acquired:
                        with count_lock:
                            inside[0] += 1
                            peak[0] = max(peak[0], inside[0])
                        time.sleep(0.001)
                        with count_lock:
                            inside[0] -= 1
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(40)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert errors == []
    assert peak[0] == 1
    assert free_elsewhere(pg_dsn, name)


def test_a_shared_wait_that_times_out_leaves_the_name_takeable(pg_dsn: str, run_id: str) -> None:
    """Probe: a shared wait_lock timing out raises LockTimeout in time and leaks no claim."""
    name = f"wt:{run_id}"
    with psycopg.connect(pg_dsn, autocommit=True) as elsewhere:
        elsewhere.execute("SELECT pg_advisory_lock(%s)", (lock_key(name),))
        started = time.monotonic()
        with pytest.raises(LockTimeout):
            lock(pg_dsn, name, wait=True, timeout=0.3).acquire()
        assert time.monotonic() - started < 1.5
        elsewhere.execute("SELECT pg_advisory_unlock_all()")
    with lock(pg_dsn, name) as again:
        assert again.acquired


def test_a_failed_shared_session_open_leaks_no_claim(pg_dsn: str, run_id: str) -> None:
    """Probe: when no shared session can be opened, the name is not left claimed in the process."""
    bad = pg_dsn.replace("port=5432", "port=1") if "port=5432" in pg_dsn else pg_dsn + " port=1"
    with pytest.raises(LockUnavailable):
        lock(bad, f"c:{run_id}", connect_timeout=2).acquire()
    with lock(pg_dsn, f"c:{run_id}") as again:  # not left claimed in this process
        assert again.acquired


def test_a_shared_lock_dropped_without_release_is_freed_and_unclaimed(
    pg_dsn: str, run_id: str
) -> None:
    """Probe: a shared lock dropped while held is unlocked and unclaimed by the scheduler."""
    name = f"drop:{run_id}"
    dropped = lock(pg_dsn, name, shared_sessions=1)
    assert dropped.acquire()
    del dropped
    gc.collect()
    wait_until(
        lambda: free_elsewhere(pg_dsn, name),
        5,
        "the dropped lock to be unlocked",
    )
    with lock(pg_dsn, name, shared_sessions=1) as again:  # and not left claimed here
        assert again.acquired
    with lock(pg_dsn, name, shared_sessions=1) as again:
        assert again.acquired
