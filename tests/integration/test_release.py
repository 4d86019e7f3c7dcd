"""G10, a release is a release: when it returns, the server has freed the lock.

Under every strategy, whatever the holder did before (took its connection, left a
transaction open, raised), another session takes the lock on its first try the
moment release() returns; a release whose backend is paused returns only once the
backend is back and has freed the lock.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time

import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pglock_celery import LockLost
from tests.support.locks import DEDICATED, STRATEGIES, free_elsewhere, lock
from tests.support.services import wait_until

pytestmark = pytest.mark.usefixtures("empty_cache")  # no idle session across tests


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_release_waits_for_a_paused_backend_and_the_lock_is_free_when_it_returns(
    pg_dsn: str, run_id: str, strategy: str
) -> None:
    name = f"paused:{run_id}:{strategy}"
    held = lock(pg_dsn, name, strategy=strategy)
    assert held.acquire()
    backend = held.backend_pid
    assert backend is not None
    returned: list[float] = []
    os.kill(backend, signal.SIGSTOP)
    try:
        releasing = threading.Thread(
            target=lambda: (held.release(), returned.append(time.monotonic()))
        )
        releasing.start()
        releasing.join(1.0)
        assert not returned, "release returned while its backend was paused"
        resumed = time.monotonic()
    finally:
        os.kill(backend, signal.SIGCONT)
    releasing.join(10)
    assert returned and returned[0] >= resumed
    assert free_elsewhere(pg_dsn, name)


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    strategy=st.sampled_from(STRATEGIES),
    used=st.sampled_from(["nothing", "connection", "open transaction", "transaction"]),
    raised=st.booleans(),
)
def test_whatever_the_holder_did_another_session_takes_the_lock_right_after_release(
    pg_dsn: str, run_id: str, strategy: str, used: str, raised: bool
) -> None:
    name = f"free:{run_id}"
    if strategy == "shared":
        used = "nothing"  # a shared session runs no SQL of a holder's
    held = lock(pg_dsn, name, strategy=strategy)
    with pytest.raises(RuntimeError) if raised else contextlib.nullcontext():
        with held:
            assert held.acquired
            if used == "connection":
                held.connection.execute("SELECT 1")
            elif used == "open transaction":
                held.connection.execute("BEGIN")
                held.connection.execute("SELECT 1")
            elif used == "transaction":
                with held.transaction() as conn:
                    conn.execute("SELECT 1")
            if raised:
                raise RuntimeError("the body failed")
    assert free_elsewhere(pg_dsn, name), f"{strategy}/{used}: held after release"


#: How long a release may take when a statement keeps its session busy: the wait for the
#: session's guard (the statement deadline, 5 s) and the server ending the backend.
BUSY_RELEASE_BOUND = 12.0


@pytest.mark.parametrize("busy", ["a statement sent around psycopg", "an open pipeline"])
@pytest.mark.parametrize("strategy", DEDICATED)
def test_a_release_with_a_statement_still_running_returns_only_once_the_lock_is_free(
    pg_dsn: str, run_id: str, strategy: str, busy: str
) -> None:
    """The holder leaves a long statement running on its session: release() ends the
    backend from outside and returns once the server freed the lock (G10)."""
    name = f"busy:{run_id}"
    held = lock(pg_dsn, name, strategy=strategy)
    assert held.acquire()
    conn = held.connection
    stack = contextlib.ExitStack()
    if busy == "an open pipeline":
        stack.enter_context(conn.pipeline())
        conn.execute("SELECT pg_sleep(30)")
        conn.pgconn.flush()
    else:
        conn.pgconn.send_query(b"SELECT pg_sleep(30)")
    started = time.monotonic()
    with contextlib.suppress(LockLost):
        held.release()
    took = time.monotonic() - started
    free = free_elsewhere(pg_dsn, name)
    with contextlib.suppress(psycopg.Error):
        stack.close()  # the pipeline ends on a connection that is gone
    assert free, f"{busy}: the lock was held after release"
    assert took < BUSY_RELEASE_BOUND, f"{busy}: release took {took:.1f} s"


@pytest.mark.parametrize("strategy", DEDICATED)
def test_a_release_behind_another_threads_statement_ends_it_within_the_bound(
    pg_dsn: str, run_id: str, strategy: str
) -> None:
    """Another thread of the holder is in a long statement on the lock's connection:
    release() does not wait for it past the deadline, and the lock is free when it
    returns."""
    name = f"other:{run_id}"
    held = lock(pg_dsn, name, strategy=strategy)
    assert held.acquire()
    conn = held.connection
    outcome: list[BaseException | None] = []

    def statement() -> None:
        try:
            conn.execute("SELECT pg_sleep(30)")
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=statement)
    thread.start()
    with psycopg.connect(pg_dsn, autocommit=True) as look:
        wait_until(
            lambda: look.execute(
                "SELECT 1 FROM pg_stat_activity WHERE pid = %s AND query LIKE 'SELECT pg_sleep%%'",
                (held.backend_pid,),
            ).fetchone(),
            10,
            "the other thread's statement to run",
        )
    started = time.monotonic()
    with contextlib.suppress(LockLost):
        held.release()
    took = time.monotonic() - started
    assert free_elsewhere(pg_dsn, name)
    assert took < BUSY_RELEASE_BOUND, f"release took {took:.1f} s"
    thread.join(10)
    assert len(outcome) == 1 and isinstance(outcome[0], psycopg.Error), outcome
