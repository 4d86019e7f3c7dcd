"""Helpers of the tests of unwaited unlocks: warm sessions, paused backends, free names."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator
from typing import Any

import psycopg

from pglock_celery import lock_key, sessions
from pglock_celery.config import PglockConfig
from pglock_celery.lock import AdvisoryLock

#: How long a paused backend stays paused when the code under test must wait for it.
PAUSE = 0.5


def lock(dsn: str, name: str, **options: Any) -> AdvisoryLock:
    return AdvisoryLock(name, config=PglockConfig(dsn=dsn, strategy="reuse"), **options)


def warm(dsn: str, sessions_wanted: int = 1) -> None:
    """Have the cache hold sessions that ran the unlock twice: it is prepared there
    now, and only a prepared unlock goes out without waiting."""
    for _ in range(2):
        with contextlib.ExitStack() as stack:
            for i in range(sessions_wanted):
                assert stack.enter_context(lock(dsn, f"warm:{os.getpid()}:{i}")).acquired
    assert sessions.idle_count() == sessions_wanted


def free(admin: psycopg.Connection[Any], name: str) -> bool:
    """Whether another session can take ``name`` now (it lets it go at once)."""
    got = admin.execute("SELECT pg_try_advisory_lock(%s)", (lock_key(name),)).fetchone()
    if got and got[0]:
        admin.execute("SELECT pg_advisory_unlock_all()")
    return bool(got and got[0])


@contextlib.contextmanager
def paused(backend: int) -> Iterator[threading.Event]:
    """Stop one of the test's own backends now; it goes on after PAUSE (the event is
    set then), or on the way out at the latest."""
    resumed = threading.Event()
    resuming = threading.Lock()

    def resume() -> None:
        with resuming:
            if not resumed.is_set():
                os.kill(backend, signal.SIGCONT)
                resumed.set()

    os.kill(backend, signal.SIGSTOP)
    timer = threading.Timer(PAUSE, resume)
    timer.start()
    try:
        yield resumed
    finally:
        timer.cancel()
        resume()
