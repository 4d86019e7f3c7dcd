"""The scheduler thread: starts a hold's monitor once it has lasted a check interval.

It also does what may not run where it is asked for: freeing what locks dropped
without release left behind (a finalizer may run inside any code that holds a
lock, so it only hands its work on), and the chores other modules give it (the
unwaited unlocks of idle sessions, see protocol.py).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable

from . import sessions, shared
from .exceptions import LockLost
from .lock_session import LockSession
from .monitor import Hold

logger = logging.getLogger("pglock_celery.lock")


#: Locks dropped without release, freed by the scheduler thread.
abandoned: deque[Callable[[], None]] = deque()


def abandon(session: LockSession, hold: Hold | None, label: str) -> None:
    """A lock object dropped without release: have its session and lock freed."""
    abandoned.append(functools.partial(_free, session, hold, label))
    scheduler.wake()


def _free(session: LockSession, hold: Hold | None, label: str) -> None:
    if session.pid != os.getpid():
        return
    if hold is not None:
        hold.end()
        scheduler.unwatch(hold)
    if session.shared:
        if hold is not None:
            with contextlib.suppress(LockLost):
                shared.release(session, hold, label)
        return
    session.revoke("the lock was dropped without release")
    sessions.discard(session)


def free_abandoned() -> None:
    """Free what dropped locks left behind (their sessions, their locks)."""
    while abandoned:
        try:
            abandoned.popleft()()
        except IndexError:
            return
        except Exception:
            logger.exception("freeing a lock dropped without release failed")


class _MonitorScheduler:
    """Starts a hold's monitor thread once it has lasted one check interval.

    Most steps end sooner and never pay for a thread. One scheduler thread per
    process (started on first use, and anew in a forked child) ticks every
    quarter interval while locks are held, so no thread switch is paid per lock;
    a hold's first check comes at most 1.25 intervals after its grant.
    """

    #: Idle ticks before the thread sleeps until the next lock.
    IDLE_TICKS = 20
    #: The slowest tick, in seconds, whatever the check intervals.
    MAX_TICK = 0.5

    def __init__(self) -> None:
        #: Run every tick; each returns whether it has work left (the thread keeps ticking).
        self.chores: list[Callable[[], bool]] = []
        self._reset()
        os.register_at_fork(after_in_child=self._reset)

    def _reset(self) -> None:
        # In a forked child the parent's thread is gone, and so is whoever held the
        # condition's lock at the fork: start from nothing.
        self._cond = threading.Condition(threading.RLock())
        self._held: dict[int, Hold] = {}
        self._running = False
        self._asleep = False
        self._tick = self.MAX_TICK

    def watch(self, hold: Hold) -> None:
        with self._cond:
            self._held[id(hold)] = hold
            # The shortest interval of all sets the pace. The thread is woken only when
            # the pace quickens or it sleeps: no thread switch for most locks.
            tick = hold.config.check_interval / 4
            if tick < self._tick or self._asleep or not self._running:
                self._tick = min(self._tick, tick)
                self._wake()

    def wake(self) -> None:
        """Have the thread free what dropped locks left (see ``abandoned``)."""
        with self._cond:  # re-entrant: safe from a finalizer in any code of ours
            self._wake()

    def _wake(self) -> None:
        if not self._running:
            self._running, self._asleep = True, False
            threading.Thread(target=self._run, name="pglock-monitors", daemon=True).start()
        else:
            self._cond.notify()

    def unwatch(self, hold: Hold) -> None:
        with self._cond:
            self._held.pop(id(hold), None)

    def _run(self) -> None:
        cond = self._cond
        idle, busy = 0, False
        while True:
            with cond:
                if cond is not self._cond:
                    return  # a forked child's copy of a thread that is not there
                idle = 0 if self._held or busy else idle + 1
                if idle > self.IDLE_TICKS:
                    self._asleep = True
                    cond.wait_for(lambda: bool(self._held or abandoned))
                    self._asleep, idle = False, 0
                now = time.monotonic()
                due = [
                    hold
                    for hold in self._held.values()
                    if now - hold.since >= hold.config.check_interval
                ]
                for hold in due:
                    del self._held[id(hold)]
                if not self._held:
                    self._tick = self.MAX_TICK
                tick = self._tick
            free_abandoned()
            busy = False
            for chore in self.chores:
                try:
                    busy = chore() or busy
                except Exception:
                    logger.exception("a chore of the monitor scheduler failed")
            for hold in due:
                if not hold.ended:
                    threading.Thread(
                        target=hold.monitor, name=f"pglock-monitor {hold.label}", daemon=True
                    ).start()
            with cond:
                cond.wait(tick)  # a new lock with a shorter interval wakes it


scheduler = _MonitorScheduler()
