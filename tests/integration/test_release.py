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

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.locks import STRATEGIES, free_elsewhere, lock

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
