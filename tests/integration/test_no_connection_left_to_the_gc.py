"""Every psycopg connection the library makes is closed by the library, never by the GC.

After each way a hold ends (a release, an exception, a loss found by the monitor or by
``held()``, a backend terminated during a statement, a loss never followed by a release),
under each strategy, the test drops its references and collects garbage with warnings as
errors: psycopg's "deleted while still open" ResourceWarning, raised from ``__del__``, is
unraisable, so ``sys.unraisablehook`` is where it shows.
"""

from __future__ import annotations

import contextlib
import gc
import sys
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest

from pglock_celery import LockLost
from pglock_celery.lock import AdvisoryLock
from pglock_celery.sources import registry
from tests.support.locks import DEDICATED, STRATEGIES, finish, lock, terminate
from tests.support.services import wait_until


@pytest.fixture
def left_to_the_gc() -> Iterator[Callable[[], list[str]]]:
    """Collect garbage; return what the GC found still open (unraisable warnings)."""
    found: list[str] = []

    def hook(unraisable: Any) -> None:
        found.append(f"{unraisable.exc_type.__name__}: {unraisable.exc_value}")

    def collect() -> list[str]:
        for _ in range(3):
            gc.collect()
        return found

    before = sys.unraisablehook
    sys.unraisablehook = hook
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        yield collect
    sys.unraisablehook = before


def _released(dsn: str, name: str, strategy: str) -> None:
    held = lock(dsn, name, strategy=strategy)
    assert held.acquire()
    if strategy in DEDICATED:
        held.connection.execute("SELECT 1")
    held.release()


def _raised(dsn: str, name: str, strategy: str) -> None:
    with contextlib.suppress(ZeroDivisionError), lock(dsn, name, strategy=strategy) as held:
        assert held.acquired
        if strategy in DEDICATED:
            held.connection.execute("SELECT 1")
        raise ZeroDivisionError


def _terminated(held: AdvisoryLock, dsn: str) -> None:
    backend = held.backend_pid
    assert backend is not None
    assert terminate(dsn, backend)


def _lost_to_the_monitor(dsn: str, name: str, strategy: str) -> None:
    held = lock(dsn, name, strategy=strategy, check_interval=0.2, on_lost="raise")
    assert held.acquire()
    _terminated(held, dsn)
    wait_until(lambda: held.loss is not None, 10, "the monitor to find the loss")
    finish(held)


def _lost_to_held(dsn: str, name: str, strategy: str) -> None:
    held = lock(dsn, name, strategy=strategy, check_interval=60)
    assert held.acquire()
    _terminated(held, dsn)
    wait_until(lambda: not held.held(), 10, "held() to find the loss")
    finish(held)


def _terminated_during_a_statement(dsn: str, name: str, strategy: str) -> None:
    held = lock(dsn, name, strategy=strategy, check_interval=60, on_lost="raise")
    assert held.acquire()
    conn = held.connection
    backend = held.backend_pid
    assert backend is not None
    with contextlib.suppress(psycopg.Error, LockLost):
        _in_statement_while_terminated(conn, dsn, backend)
    finish(held)


def _in_statement_while_terminated(conn: psycopg.Connection[Any], dsn: str, backend: int) -> None:
    def end_it() -> None:
        with psycopg.connect(dsn, autocommit=True) as admin:
            wait_until(
                lambda: admin.execute(
                    "SELECT 1 FROM pg_stat_activity WHERE pid = %s AND state = 'active'",
                    (backend,),
                ).fetchone(),
                10,
                "the holder's statement to run",
            )
            admin.execute("SELECT pg_terminate_backend(%s)", (backend,))

    ender = threading.Thread(target=end_it)
    ender.start()
    try:
        conn.execute("SELECT pg_sleep(10)")
    finally:
        ender.join(20)


def _lost_and_never_released(dsn: str, name: str, strategy: str) -> None:
    held = lock(dsn, name, strategy=strategy, check_interval=0.2, on_lost="raise")
    assert held.acquire()
    if strategy in DEDICATED:
        held.connection.execute("SELECT 1")
    _terminated(held, dsn)
    wait_until(lambda: held.loss is not None, 10, "the monitor to find the loss")


ENDINGS = {
    "released": (_released, STRATEGIES),
    "raised": (_raised, STRATEGIES),
    "lost-to-the-monitor": (_lost_to_the_monitor, STRATEGIES),
    "lost-to-held": (_lost_to_held, STRATEGIES),
    "terminated-during-a-statement": (_terminated_during_a_statement, DEDICATED),
    "lost-and-never-released": (_lost_and_never_released, STRATEGIES),
}


@pytest.mark.parametrize(
    ("ending", "strategy"),
    [(ending, strategy) for ending, (_, strategies) in ENDINGS.items() for strategy in strategies],
)
def test_no_connection_of_the_library_is_left_open_for_the_gc(
    pg_dsn: str,
    run_id: str,
    ending: str,
    strategy: str,
    left_to_the_gc: Callable[[], list[str]],
) -> None:
    ENDINGS[ending][0](pg_dsn, f"gc:{ending}:{run_id}", strategy)
    registry.close()  # the sessions kept for later locks are closed by the library too
    assert left_to_the_gc() == []


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_session_lost_while_a_statement_is_under_way_is_closed_as_that_statement_ends(
    pg_dsn: str, run_id: str, strategy: str, left_to_the_gc: Callable[[], list[str]]
) -> None:
    """The loss is found (by the monitor, from outside) while the session's guard is held
    as by a statement under way; as that statement lets go, the session is closed."""
    held = lock(pg_dsn, f"gc:busy:{run_id}", strategy=strategy, check_interval=0.2, on_lost="raise")
    assert held.acquire()
    session = held._hold.session  # type: ignore[union-attr]
    assert session is not None
    statement_under_way = session.guard
    assert statement_under_way.acquire()
    try:
        _terminated(held, pg_dsn)
        wait_until(lambda: held.loss is not None, 10, "the monitor to find the loss")
        assert not session.closed  # the statement under way still owns the socket
    finally:
        statement_under_way.release()
    assert session.closed  # by the library, as the statement let go
    finish(held)
    registry.close()
    assert left_to_the_gc() == []
