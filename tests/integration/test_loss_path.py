"""A loss never waits for the session, and the cut it makes reaches only its own session.

Hold.mark_lost records a loss without the session's guard, then the source's end_use
shuts the session's socket down (LockSession.cut) before anyone is told. These tests
put a pause where the race windows are a few bytecodes wide (at the entry of
DedicatedSource.end_use, and inside LockSession.cut before it pins the descriptor);
everything else is real: Postgres, sessions, the monitor thread. Each runs over TCP and
over the server's Unix socket, where every client socket has the same address.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from pglock_celery import LockLost
from pglock_celery import session as session_module
from pglock_celery.sources import registry
from pglock_celery.sources.dedicated import DedicatedSource
from tests.support.locks import free_elsewhere, lock
from tests.support.services import over_unix_socket, wait_until

pytestmark = pytest.mark.usefixtures("empty_cache")


@pytest.fixture(params=["tcp", "unix"])
def dsn(request: pytest.FixtureRequest, pg_dsn: str) -> str:
    return pg_dsn if request.param == "tcp" else over_unix_socket(pg_dsn)


class _PausingOs:
    """Stands in for ``os`` in pglock_celery.session: pauses a cut after it read the
    session's descriptor number and before it pins it (all else passes through)."""

    def __init__(self) -> None:
        self.reached = threading.Event()
        self.go = threading.Event()
        self.finished = threading.Event()
        self.fds: list[int] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)

    def dup(self, fd: int) -> int:
        if sys._getframe(1).f_code.co_name == "cut":
            self.fds.append(fd)
            self.reached.set()
            self.go.wait(30)
        return os.dup(fd)


@pytest.fixture
def pause_in_cut(monkeypatch: pytest.MonkeyPatch) -> Iterator[_PausingOs]:
    proxy = _PausingOs()
    real_cut = session_module.LockSession.cut

    def cut(self: Any) -> None:
        try:
            real_cut(self)
        finally:
            proxy.finished.set()

    monkeypatch.setattr(session_module, "os", proxy)
    monkeypatch.setattr(session_module.LockSession, "cut", cut)
    yield proxy
    proxy.go.set()


@pytest.fixture
def pause_before_cut(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, threading.Event]]:
    """Pause ``DedicatedSource.end_use`` at its entry (mark_lost has recorded the loss)."""
    events = {"reached": threading.Event(), "go": threading.Event(), "done": threading.Event()}
    real = DedicatedSource.end_use

    def paused(self: Any, hold: Any, loss: Any) -> None:
        events["reached"].set()
        events["go"].wait(30)
        try:
            real(self, hold, loss)
        finally:
            events["done"].set()

    monkeypatch.setattr(DedicatedSource, "end_use", paused)
    yield events
    events["go"].set()


def backend_state(admin: psycopg.Connection[Any], pid: int) -> tuple[str, str] | None:
    row = admin.execute(
        "SELECT state, query FROM pg_stat_activity WHERE pid = %s", (pid,)
    ).fetchone()
    return (row[0], row[1]) if row else None


def lowest_free_fd_is(fd: int) -> list[int]:
    """Fill the descriptor numbers below ``fd`` so that the next one opened gets ``fd``.

    Returns the fillers (the caller closes them). Fails if ``fd`` is not free.
    """
    fillers: list[int] = []
    while True:
        got = os.dup(0)
        if got == fd:
            os.close(got)
            return fillers
        if got > fd:
            os.close(got)
            for f in fillers:
                os.close(f)
            raise AssertionError(f"descriptor {fd} is not free: the session still has it")
        fillers.append(got)


def test_a_late_cut_of_a_lost_hold_never_frees_the_next_holders_lock(
    dsn: str,
    run_id: str,
    pause_before_cut: dict[str, threading.Event],
    pause_in_cut: _PausingOs,
) -> None:
    """G11: one holder's action never frees another holder's lock.

    H1's holder unlocks its own lock by hand (a holder's statement); the monitor finds
    it lost and, as the body starts another statement, cuts H1's session. The cut read
    the descriptor number; then H1's statement ends, H1 releases (LockLost, session
    closed: libpq closes the descriptor) and H2 takes its lock on a new session, which
    gets the same descriptor number. The cut then goes on: it pins what the number
    names now, finds another socket (by inode) and leaves H2's session alone.
    """
    first, second = f"cut-1:{run_id}", f"cut-2:{run_id}"
    h1 = lock(dsn, first, strategy="connect", check_interval=0.2)
    h2 = lock(dsn, second, strategy="connect", check_interval=60)
    admin = psycopg.connect(dsn, autocommit=True)
    fillers: list[int] = []
    body_error: dict[str, BaseException | None] = {}
    try:
        assert h1.acquire()
        backend1 = h1.backend_pid
        assert backend1 is not None
        conn = h1.connection
        # H1's holder unlocks its own lock (taken twice by the library: count 2).
        conn.execute("SELECT pg_advisory_unlock_all()")
        assert pause_before_cut["reached"].wait(10), "the monitor did not find H1's loss"
        assert h1.lost_reason is not None

        def body() -> None:
            try:
                conn.execute("SELECT pg_sleep(1.5)")
                body_error["statement"] = None
            except BaseException as exc:
                body_error["statement"] = exc
            try:
                h1.release()
                body_error["release"] = None
            except BaseException as exc:
                body_error["release"] = exc

        worker = threading.Thread(target=body, daemon=True)
        worker.start()
        wait_until(
            lambda: (backend_state(admin, backend1) or ("", ""))[0] == "active",
            10,
            "H1's statement to be under way",
        )
        pause_before_cut["go"].set()  # the cut finds the guard busy
        assert pause_in_cut.reached.wait(10), "the cut was not reached"
        fd = pause_in_cut.fds[0]
        worker.join(15)
        assert not worker.is_alive()
        assert isinstance(body_error["release"], LockLost)  # H1's loss, told at release
        fillers = lowest_free_fd_is(fd)
        assert h2.acquire()
        assert h2.acquired and h2._hold is not None and h2._hold.session is not None
        assert h2._hold.session.pgconn.socket == fd, "precondition: H2 got the number"
        for f in fillers:
            os.close(f)
        fillers = []
        assert not free_elsewhere(admin, second)
        pause_in_cut.go.set()  # the cut of H1 goes on
        assert pause_in_cut.finished.wait(10), "the cut of H1 did not end"
        freed = free_elsewhere(admin, second)
        still = h2.held()
        assert not freed and still, (
            f"H1's late cut shut H2's session down: H2's lock free elsewhere={freed}, "
            f"H2.held()={still}, H2.lost_reason={h2.lost_reason!r}"
        )
    finally:
        pause_before_cut["go"].set()
        pause_in_cut.go.set()
        for f in fillers:
            os.close(f)
        with contextlib.suppress(LockLost):
            h1.release()
        with contextlib.suppress(LockLost):
            h2.release()
        admin.close()


def test_a_release_racing_a_recorded_loss_keeps_no_session_and_its_cut_spares_the_next_holder(
    dsn: str,
    run_id: str,
    pause_before_cut: dict[str, threading.Event],
) -> None:
    """Strategy reuse: mark_lost recorded H1's loss (no guard taken) and is about to cut;
    H1's body releases meanwhile. The release must say LockLost, the session must not go
    back idle, and the late cut must not reach H2's session (which may reuse a session or
    its descriptor number)."""
    first, second = f"race-1:{run_id}", f"race-2:{run_id}"
    h1 = lock(dsn, first, strategy="reuse", check_interval=0.2)
    h2 = lock(dsn, second, strategy="reuse", check_interval=0.2)
    admin = psycopg.connect(dsn, autocommit=True)
    try:
        assert h1.acquire()
        source = registry.source(h1.config)
        h1.connection.execute("SELECT pg_advisory_unlock_all()")
        assert pause_before_cut["reached"].wait(10), "the monitor did not find H1's loss"
        with pytest.raises(LockLost):
            h1.release()
        assert source.idle_count() == 0  # type: ignore[attr-defined]
        assert h2.acquire()
        outcome: dict[str, BaseException | None] = {}

        def h2_statement() -> None:  # H2's session busy when H1's cut goes on
            try:
                h2.connection.execute("SELECT pg_sleep(1.5)")
                outcome["error"] = None
            except BaseException as exc:
                outcome["error"] = exc

        busy = threading.Thread(target=h2_statement, daemon=True)
        busy.start()
        backend2 = h2.backend_pid
        assert backend2 is not None
        wait_until(
            lambda: (backend_state(admin, backend2) or ("", ""))[0] == "active",
            10,
            "H2's statement to be under way",
        )
        pause_before_cut["go"].set()
        busy.join(10)
        assert outcome["error"] is None, outcome["error"]
        assert pause_before_cut["done"].wait(10), "the cut of H1 did not end"
        assert not free_elsewhere(admin, second)
        assert h2.held(), h2.lost_reason
    finally:
        pause_before_cut["go"].set()
        with contextlib.suppress(LockLost):
            h1.release()
        with contextlib.suppress(LockLost):
            h2.release()
        admin.close()
