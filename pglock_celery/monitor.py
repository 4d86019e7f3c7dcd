"""Where a loss is detected, and what happens then.

A :class:`Hold` is one holding of a lock, from its grant to its release, with its
own loss state, so nothing of an earlier hold (a released one, one on a session
that died while idle) can leave a later one unwatched.

The :class:`Monitor` of a process (one, in the registry of sources/) checks every
hold that has lasted a check interval, and again every interval, through its
source (``source.check``): between transactions it asks the server (alive, still
holding the lock, a primary); inside the body's transaction it peeks at the
socket only. A check never waits for a statement of the holder's: a busy session
is checked at the next pass. Threads are bounded whatever the number of holds:
one scheduler thread, and at most ``MAX_CHECKERS`` checker threads, so that one
session hung in a statement does not stop the others being checked. A thread
that cannot be started is tried again at the next pass, the check meanwhile run
by the scheduler itself.

Under gevent's and eventlet's monkey-patching those threads are greenlets, which
a body that computes without yielding keeps from running. One real OS thread of
the worker then watches too (Monitor._watch_natively): it never runs a statement
nor takes a green lock, so it cannot touch a session a greenlet uses; it judges
from outside (the socket peek, a fenced hold's confirmation) every hold whose
greenlet check is overdue, and hands a loss to the hub's thread (the main one)
with INTERRUPT_SIGNAL, whose handler handles it in the body that lost it when
that body is the greenlet running, and otherwise in a new greenlet of the hub.

A loss (a :class:`~.loss.Loss`, its kind chosen where it was found) is handled
in one order that nothing cuts short: it is recorded on the hold, the source ends
the holder's use of the session (a dedicated session is cut, so no statement of
the holder's reaches the server after; a shared session that failed takes every
lock on it), and only then is the holder told (its loss handler: an event, the
interrupt).

A :class:`Body` is the code running under a hold, and how to raise LockLost
inside it from the thread that found the loss (``pglock_on_lost = "interrupt"``):
a greenlet (gevent, eventlet) is thrown into by its hub, or, running when the
native watch signals, has LockLost raised by the signal handler; the main thread
(prefork and solo pools) gets a signal whose handler raises; another thread
(the threads pool) gets an asynchronous exception, which CPython raises at its
next bytecode (not inside a blocking C call such as ``time.sleep``: it comes
when that returns). Nothing is sent once the body has returned (an asynchronous
exception sent a moment before may surface as the call ends: see Body.end), nor
to a body that found the loss itself (it learns from what it called), and an
interrupt that comes while the body is inside the library's code is held back
until that code returns (shield.py).
"""

from __future__ import annotations

import ctypes
import logging
import os
import queue
import signal
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from types import FrameType
from typing import Any, Protocol

import psycopg

from .config import PglockConfig
from .exceptions import LockLost, lost_during_step
from .loss import Loss, LossKind, session_ended
from .session import LockSession
from .shield import running_body

logger = logging.getLogger("pglock_celery.lock")

#: Called (from a monitor thread, or the body's own) when a held lock is found lost.
LossHandler = Callable[["Hold", Loss], None]


def one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())


class Source(Protocol):
    """What a hold needs of its source (sources/): a check, and what to do on a loss."""

    monitor: Monitor

    def check(self, hold: Hold) -> Loss | None: ...

    def check_interval(self, hold: Hold) -> float:
        """Seconds between two checks of ``hold``."""

    def confirmed_until(self, hold: Hold) -> float | None:
        """Until when ``hold``'s server is confirmed as its cluster's leader, without
        any I/O (time.monotonic()); None when no leader source fences it."""

    def end_use(self, hold: Hold, loss: Loss) -> None:
        """End the holder's use of its session after ``loss``, never waiting for it."""


class Hold:
    """One holding of a lock, from its grant to its release: what the monitor watches.

    It never refers to its AdvisoryLock, so a lock dropped without release can be
    collected, and its finalizer frees the session.
    """

    def __init__(
        self,
        source: Source,
        *,
        key: int,
        label: str,
        application_name: str,
        task_id: str | None,
        config: PglockConfig,
        on_lost: LossHandler | None,
    ) -> None:
        self.source = source
        self.key = key
        self.label = label
        self.application_name = application_name
        self.task_id = task_id
        self.config = config
        self.on_lost = on_lost
        #: The session the lock was tried on (kept after a refused try, for the
        #: holder lookup); None until the source found one.
        self.session: LockSession | None = None
        self.granted = False
        self.since = time.monotonic()
        #: How the lock was found lost, or None.
        self.lost: Loss | None = None
        #: The loss the release found (its session failed, the lock was gone): set by
        #: the source, reported by the lock once the release has ended the session's use.
        self.found_at_release: Loss | None = None
        self.ended = False
        #: The statement (its start, as the server gives it) whose commit a check first
        #: saw wait for synchronous replication, and when (time.monotonic()); None
        #: while no commit waits.
        self.replication_wait_seen: tuple[bytes, float] | None = None
        #: The holder's connection (dedicated) or its transaction's (shared).
        self.handle: psycopg.Connection[Any] | None = None
        # Set at release or loss; made only when someone waits (most holds end unwatched).
        self._changed: threading.Event | None = None
        self._next_check = 0.0
        #: The check interval, as last asked of the source (the native watch reads it:
        #: the source may take a green lock to answer).
        self._interval = config.check_interval
        self._checking = False
        #: The monitor found its leader confirmation run out (handled once).
        self._ran_out = False
        # Orders a loss against the end (never held across a statement: a holder's
        # statement may wait on a server that never answers).
        self._state = threading.Lock()
        #: Under gevent and eventlet: the greenlet that took the hold (its body runs
        #: there), the OS thread of its hub, and a loss the native watch found that
        #: the hub has yet to handle (Monitor._hand_back).
        self._greenlet, self._os_thread = _where_am_i()
        self._handed_back: Loss | None = None
        self._spawned = False

    def end(self) -> None:
        """The hold is over (released, or given up in a forked child)."""
        with self._state:
            self.ended = True
        if self._changed is not None:
            self._changed.set()

    def _signal(self) -> None:
        changed = self._changed
        if changed is not None:
            changed.set()

    def wait(self, seconds: float) -> bool:
        """Wait up to ``seconds`` for the release or a loss; whether one came."""
        if self._changed is None:
            self._changed = threading.Event()  # a race makes two: both are checked below
        changed = self._changed
        if self.ended or self.lost is not None:
            return True
        return changed.wait(seconds)

    def mark_lost(self, loss: Loss) -> None:
        """Handle a loss once, whole: record it, end the session's use, then tell.

        Never waits for the session: a statement of the holder's may be waiting on a
        server that will never answer it (frozen, deposed), and the holder must be
        told all the same. The session's use is ended before anyone is told, so no
        statement of the holder's runs after its loss was found. A hold still
        waiting for its lock is only cut off (its wait fails: the caller raises).
        """
        if self.session is None:
            return
        with self._state:
            if self.lost is not None or self.ended:
                return
            self.lost = loss
        self.source.end_use(self, loss)
        self._signal()
        if not self.granted:
            return
        self.source.monitor.count_loss("while_held")
        self._report(loss)

    def lost_at_release(self, loss: Loss) -> None:
        """Report a loss that the release found (the lock was gone before it), once.

        The release has ended the session's use already; the holder is told as for
        any other loss (its loss handler: the event), so that every loss is reported
        once, whoever found it.
        """
        with self._state:
            if self.lost is not None or not self.granted:
                return
            self.lost = loss
        self._report(loss, ", found at release")

    def _report(self, loss: Loss, found: str = "") -> None:
        """Log ``loss`` (``found``: where, when not while held) and tell the loss handler."""
        logger.error(
            "lock %s lost by %s (task %s)%s: %s",
            self.label,
            self.application_name,
            self.task_id,
            found,
            loss.detail,
            extra={
                "lock": self.label,
                "key": self.key,
                "task_id": self.task_id,
                "holder": self.application_name,
                "reason": loss.detail,
                "loss": loss.kind.value,
            },
        )
        if self.on_lost is not None:
            self.on_lost(self, loss)


class Monitor:
    """Checks every hold of this process each check interval, with bounded threads."""

    #: Checker threads at most, whatever the number of holds.
    MAX_CHECKERS = 4
    #: The slowest pass, in seconds, whatever the check intervals.
    MAX_TICK = 0.5
    #: Passes with nothing held before the scheduler sleeps until the next hold.
    IDLE_TICKS = 20
    #: Seconds a checker thread with nothing to do waits before it ends.
    CHECKER_IDLE = 5.0

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.RLock())
        self._holds: dict[int, Hold] = {}
        self._due: queue.SimpleQueue[Hold] = queue.SimpleQueue()
        self._running = False
        # Asleep: nothing to do, waiting to be notified; else it wakes every _tick.
        self._asleep = False
        self._tick = self.MAX_TICK
        self._checkers = 0
        self._idle_checkers = 0
        #: Locks dropped without release: freed by the scheduler thread (a finalizer
        #: may run inside any code that holds a lock, so it only hands its work on).
        self.abandoned: deque[Callable[[], None]] = deque()
        #: Locks this process found lost while held (the monitor, held()) and at release.
        self.losses = {"while_held": 0, "at_release": 0}
        self._losses_lock = threading.Lock()
        #: Bodies of the main thread told to stop, for the signal handler to raise in.
        self.interrupted: list[Body] = []
        self.interrupt_handler_installed = False
        #: Under gevent and eventlet: the OS thread the native watch signals (the main
        #: thread, whose hub runs the bodies), once the watch runs; and the holds it
        #: found lost, for the signal handler to hand to the hub.
        self._watch_signals: int | None = None
        self._handed: dict[int, Hold] = {}

    def install_interrupt_handler(self) -> None:
        """Install (from the main thread) the handler that raises LockLost in its body."""
        signal.signal(INTERRUPT_SIGNAL, self._on_interrupt_signal)
        self.interrupt_handler_installed = True

    def _on_interrupt_signal(self, signum: int, frame: FrameType | None) -> None:
        if self._handed:
            self._take_handed_back()
        while self.interrupted:
            body = self.interrupted.pop()
            if body.arrived():
                raise body.lost()

    def count_loss(self, when: str) -> None:
        with self._losses_lock:
            self.losses[when] += 1

    def found_at_release(self, hold: Hold, loss: Loss) -> None:
        """The release of ``hold`` found ``loss`` (counted; the lock reports it)."""
        self.count_loss("at_release")
        hold.found_at_release = loss

    def watch(self, hold: Hold) -> None:
        """Check ``hold`` once it has lasted a check interval, and every interval after.

        The scheduler is woken only when it sleeps or must quicken its pace: most
        holds end before their first check and cost no thread switch.
        """
        interval = hold._interval = hold.source.check_interval(hold)
        hold._next_check = hold.since + interval
        with self._cond:
            self._holds[id(hold)] = hold
            if not self._running:
                self._start_scheduler()
            elif self._asleep or interval / 4 < self._tick:
                self._cond.notify()
        if self._watch_signals is None and hold._os_thread is not None:
            self._start_native_watch()

    def unwatch(self, hold: Hold) -> None:
        with self._cond:
            self._holds.pop(id(hold), None)

    def abandon(self, free: Callable[[], None]) -> None:
        """Have ``free`` run by the scheduler thread (see ``abandoned``)."""
        self.abandoned.append(free)
        with self._cond:
            if not self._running:
                self._start_scheduler()
            else:
                self._cond.notify()

    def free_abandoned(self) -> None:
        """Free what dropped locks left behind (their sessions, their locks)."""
        while self.abandoned:
            try:
                free = self.abandoned.popleft()
            except IndexError:
                return
            try:
                free()
            except Exception:
                logger.exception("freeing a lock dropped without release failed")

    def _start_scheduler(self) -> None:
        try:
            threading.Thread(target=self._schedule, name="pglock-monitor", daemon=True).start()
        except RuntimeError as exc:  # can't start new thread: the next watch tries again
            logger.error("the lock monitor thread could not be started: %s", exc)
            return
        self._running = True

    # -- the native watch (gevent, eventlet) -------------------------------------------

    def _start_native_watch(self) -> None:
        """Under gevent's or eventlet's monkey-patching, watch from a real OS thread too.

        The scheduler and checker threads above are greenlets then: a body that
        computes without yielding keeps the hub, and them, from running. The native
        watch cannot be starved so (the interpreter switches OS threads whatever a
        greenlet does). It never takes a green lock nor runs a statement: it reads
        what needs no I/O (a socket peek, a fenced hold's confirmation), and hands a
        loss to the main thread with INTERRUPT_SIGNAL, whose handler runs in the
        greenlet running there (see _take_handed_back). Started by the first hold
        watched in the main thread: there the hub runs the pool's bodies, and only
        there can the handler be installed; elsewhere the greenlet checks alone watch.
        """
        native = _native()
        if native is None:
            return
        start_new_thread, sleep, get_ident = native
        try:
            signal.signal(INTERRUPT_SIGNAL, self._on_interrupt_signal)
        except ValueError:
            return  # not the main thread: the greenlet checks alone watch (the next hold tries)
        self.interrupt_handler_installed = True
        self._watch_signals = get_ident()
        try:
            start_new_thread(self._watch_natively, (self._cond, sleep))
        except RuntimeError as exc:
            logger.error("the lock monitor's native thread could not be started: %s", exc)
            self._watch_signals = None

    def _watch_natively(self, cond: Any, sleep: Callable[[float], None]) -> None:
        """Each pass, judge every hold whose greenlet check is overdue; signal the losses."""
        while cond is self._cond:  # a forked child's copy of a thread that is not there
            now = time.monotonic()
            holds = list(self._holds.values())
            tick = min([self.MAX_TICK] + [hold._interval / 4 for hold in holds])
            for hold in holds:
                if hold._handed_back is None and hold._os_thread == self._watch_signals:
                    try:
                        loss = self._judge_natively(hold, now, tick)
                    except Exception:
                        # Judged again next pass; not logged: a log handler's lock is a
                        # green one here, which this thread must never wait for.
                        continue
                    if loss is not None:
                        self._hand_back(hold, loss)
            if self._handed and self._watch_signals is not None:
                # Again each pass until the hub has the losses: the handler may have
                # come while the body was inside the library's code.
                signal.pthread_kill(self._watch_signals, INTERRUPT_SIGNAL)
            sleep(tick)

    def _judge_natively(self, hold: Hold, now: float, tick: float) -> Loss | None:
        """How ``hold`` is lost, judged without I/O or a green lock: its confirmation as
        the leader running out (as the scheduler judges it), or, once its greenlet
        check is due and not done (the hub starved, or that check under way), its
        session ended by the server."""
        session = hold.session
        if not hold.granted or hold.ended or hold.lost is not None or session is None:
            return None
        if session.pid != os.getpid():
            return None  # a parent's session (alive() would call it gone)
        until = hold.source.confirmed_until(hold)
        if until is not None and now >= until - tick:
            return _ran_out()
        if now < hold._next_check:
            return None
        if not session.alive(take_guard=False):
            return session_ended("the lock session failed: the server closed it")
        return None

    def _hand_back(self, hold: Hold, loss: Loss) -> None:
        hold._handed_back = loss
        self._handed[id(hold)] = hold

    def _take_handed_back(self) -> None:
        """In the main thread (INTERRUPT_SIGNAL's handler): handle what the native watch
        found, in whichever greenlet runs there now.

        The greenlet running is the body of a lost hold (its lock was taken there,
        and it runs its own code, not the library's): the loss is handled here, whole,
        and LockLost raised where that body is. Any other (the hub, another body) is
        never interrupted: the loss is handled by a new greenlet, which the hub runs
        as soon as it can; its body then gets LockLost from the hub (Body.interrupt),
        and a body inside the library's code gets it as that code returns.
        """
        current = _current_greenlet()
        body = running_body.get()
        here: Hold | None = None
        for key, hold in list(self._handed.items()):
            if hold.lost is not None or hold.ended:
                self._handed.pop(key, None)
            elif here is None and _runs_its_own_code(hold, current, body):
                self._handed.pop(key, None)
                here = hold
            elif not hold._spawned:
                hold._spawned = True
                _spawn(hold.mark_lost, hold._handed_back)
        if here is None:
            return
        assert isinstance(body, Body)
        bodies = body.chain()
        told_before = [each.reason is not None for each in bodies]
        loss = here._handed_back
        assert loss is not None
        try:
            here.mark_lost(loss)
        except Exception:
            logger.exception("lock %s: handling its loss failed", here.label)
        for each, told in zip(bodies, told_before, strict=True):
            if not told and each.reason is not None and each.running:
                raise each.lost()

    def _schedule(self) -> None:
        cond = self._cond
        idle = 0
        while True:
            with cond:
                if cond is not self._cond:
                    return  # a forked child's copy of a thread that is not there
                idle = 0 if self._holds or self.abandoned else idle + 1
                if idle > self.IDLE_TICKS:
                    self._asleep = True
                    cond.wait_for(lambda: bool(self._holds or self.abandoned))
                    self._asleep, idle = False, 0
                now = time.monotonic()
                due = [
                    hold
                    for hold in self._holds.values()
                    if hold._next_check <= now and not hold._checking
                ]
                self._tick = tick = min(
                    [self.MAX_TICK]
                    + [hold.source.check_interval(hold) / 4 for hold in self._holds.values()]
                )
                # Found before the next pass is due: by then it would have run out.
                ran_out = [
                    hold
                    for hold in self._holds.values()
                    if not hold._ran_out
                    and (until := hold.source.confirmed_until(hold)) is not None
                    and now >= until - tick
                ]
                for hold in due:
                    hold._checking = True
                    self._due.put(hold)
                backlog = self._due.qsize() - self._idle_checkers
                started = self._start_checkers(backlog)
            self.free_abandoned()
            for hold in ran_out:
                self._run_out(hold)
            if due and not started and self._checkers == 0:
                self._drain()  # no checker thread could start: check here meanwhile
            with cond:
                cond.wait(tick)  # a hold that needs a quicker pace wakes it

    def _run_out(self, hold: Hold) -> None:
        """A fenced hold whose leader confirmation runs out before a check renewed it
        (its checks held up: every checker busy, a request that trickles): lost now,
        before the window closes, on a thread of its own (the holder's loss handler may
        take a while, and this thread keeps time for every hold)."""
        hold._ran_out = True
        loss = _ran_out()
        try:
            threading.Thread(
                target=hold.mark_lost, args=(loss,), name="pglock-ran-out", daemon=True
            ).start()
        except RuntimeError:
            hold.mark_lost(loss)  # no thread to spare: here, rather than not at all

    def _start_checkers(self, backlog: int) -> bool:
        """Start checker threads for ``backlog`` waiting holds, within the bound."""
        started = False
        while backlog > 0 and self._checkers < self.MAX_CHECKERS:
            try:
                threading.Thread(target=self._checker, name="pglock-check", daemon=True).start()
            except RuntimeError as exc:
                logger.error("a lock check thread could not be started: %s", exc)
                break
            self._checkers += 1
            backlog -= 1
            started = True
        return started

    def _drain(self) -> None:
        while True:
            try:
                hold = self._due.get_nowait()
            except queue.Empty:
                return
            self._check(hold)

    def _checker(self) -> None:
        cond = self._cond
        while True:
            with cond:
                self._idle_checkers += 1
            try:
                hold = self._due.get(timeout=self.CHECKER_IDLE)
            except queue.Empty:
                with cond:
                    self._idle_checkers -= 1
                    if self._due.empty() or cond is not self._cond:
                        self._checkers -= 1
                        return
                continue
            with cond:
                self._idle_checkers -= 1
            self._check(hold)

    def _check(self, hold: Hold) -> None:
        try:
            if not hold.ended and hold.lost is None:
                loss = hold.source.check(hold)
                if loss is not None:
                    hold.mark_lost(loss)
        except Exception:
            logger.exception("lock %s: the loss check failed", hold.label)
        finally:
            hold._interval = hold.source.check_interval(hold)
            hold._next_check = time.monotonic() + hold._interval
            hold._checking = False

    def after_fork_in_child(self) -> None:
        """The parent's threads are gone, and whoever held a lock of ours at the fork."""
        self._cond = threading.Condition(threading.RLock())
        self._holds = {}
        self._due = queue.SimpleQueue()
        self._running = self._asleep = False
        self._tick = self.MAX_TICK
        self._checkers = self._idle_checkers = 0
        self.abandoned.clear()
        self._losses_lock = threading.Lock()
        self.interrupted = []
        self._watch_signals = None
        self._handed = {}


#: The signal that interrupts a body running in the main thread (a real-time one: no
#: library or Celery pool uses it).
INTERRUPT_SIGNAL = signal.SIGRTMIN + 3


class Body:
    """The code running under a hold, and how to raise LockLost inside it.

    Made in the thread (or greenlet) that runs the body, just before it runs;
    its runner calls :meth:`start` and :meth:`end` around the body.
    :meth:`interrupt` may be called from any thread.
    """

    def __init__(self, label: str, monitor: Monitor, *, task: str | None = None) -> None:
        self.label = label
        #: The task whose step the body is (for the text of its LockLost), if any.
        self.task = task
        self.running = False
        self.reason: str | None = None
        # Re-entrant: the signal handler (arrived()) may run in the main thread's body
        # while that thread holds it (enter_library, leave_library).
        self._mutex = threading.RLock()
        self._monitor = monitor
        # How deep the body is in the library's code now (shield.py), and whether
        # an interrupt waits for it to come out.
        self._inside = 0
        self._held_back = False
        self._context_token: Any = None
        self._outer: Body | None = None
        # What runs the body: a gevent or eventlet greenlet, the main thread, a thread.
        self._kind: str = "thread"
        self._target: Any = threading.get_ident()
        greenlet = sys.modules.get("greenlet")
        current = greenlet.getcurrent() if greenlet is not None else None
        gevent, eventlet = sys.modules.get("gevent"), sys.modules.get("eventlet.greenthread")
        if gevent is not None and isinstance(current, gevent.Greenlet):
            self._kind, self._target = "gevent", current
        elif eventlet is not None and isinstance(current, eventlet.GreenThread):
            self._kind, self._target = "eventlet", current
        elif self._target == threading.main_thread().ident:
            self._kind = "main"
            if not monitor.interrupt_handler_installed:
                monitor.install_interrupt_handler()

    def start(self) -> None:
        """The body starts (in its own thread or greenlet): it may be interrupted now."""
        outer = running_body.get()
        self._outer = outer if isinstance(outer, Body) else None
        self._context_token = running_body.set(self)
        self.running = True

    def chain(self) -> list[Body]:
        """This body, then those it runs inside (a locked call made inline in a body)."""
        bodies: list[Body] = []
        body: Body | None = self
        while body is not None:
            bodies.append(body)
            body = body._outer
        return bodies

    def _is_here(self) -> bool:
        """Whether the caller runs in the body's own thread or greenlet."""
        if self._kind in ("gevent", "eventlet"):
            greenlet = sys.modules.get("greenlet")
            return greenlet is not None and bool(greenlet.getcurrent() is self._target)
        return bool(threading.get_ident() == self._target)

    def interrupt(self, reason: str) -> bool:
        """Raise LockLost inside the running body; whether it was still running.

        Found by the body itself (``held()``, a transaction's proof), nothing is
        sent: it learns from what it called. Inside the library's code, the
        interrupt is held back until that code returns.
        """
        with self._mutex:
            if not self.running or self.reason is not None:
                return False
            self.reason = reason
            if self._is_here():
                return True
            if self._inside:
                self._held_back = True
                return True
            if self._kind == "main":
                self._monitor.interrupted.append(self)
                signal.pthread_kill(self._target, INTERRUPT_SIGNAL)
            elif self._kind == "thread":
                _async_raise(self._target, Interrupted)
            elif self._kind == "gevent":
                import gevent  # type: ignore[import-untyped]

                gevent.get_hub().loop.run_callback(self._throw)
            else:
                from eventlet import hubs  # type: ignore[import-untyped]

                hubs.get_hub().schedule_call_global(0, self._throw)
            return True

    def enter_library(self) -> None:
        with self._mutex:
            self._inside += 1

    def leave_library(self) -> None:
        """Leave the library's code; raise the interrupt held back meanwhile, if any."""
        with self._mutex:
            self._inside -= 1
            due = self._held_back and not self._inside and self.running
            if due:
                self._held_back = False
        if due:
            raise self.lost()

    def arrived(self) -> bool:
        """In the body's thread (the signal handler): raise now, or hold it back?

        True when LockLost is to be raised where the body is; inside the
        library's code it is held back for leave_library.
        """
        with self._mutex:
            if not self.running:
                return False
            if self._inside:
                self._held_back = True
                return False
            return True

    def end(self) -> None:
        """The body returned: nothing is sent to it from now on.

        An asynchronous exception sent to a pool thread a moment before is not taken
        back: CPython 3.11 offers no safe way (SetAsyncExc with NULL leaves the
        interpreter's pending flag set, slowing every thread's bytecode from then
        on); it then surfaces as the call ends, which ends with LockLost.
        """
        with self._mutex:
            self.running = False
            self._held_back = False
            # An interrupt raised as the body entered the library's code (between the
            # count and its block) left the count up: nothing is sent any more anyway.
            self._inside = 0
        if self._context_token is not None:
            running_body.reset(self._context_token)
            self._context_token = None

    def _throw(self) -> None:
        """In the hub: throw into the body's greenlet, unless it has ended meanwhile."""
        if self.arrived():
            self._target.throw(self.lost())

    def lost(self) -> LockLost:
        return LockLost(lost_during_step(self.label, self.reason or "", self.task))


class Interrupted(LockLost):
    """LockLost raised inside a pool thread's body by another thread.

    CPython raises a class there, never an instance: it is made in the body's own
    thread, which gives it its body's text (the same words as under every other
    pool). One that surfaces after its body ended has the plain text; the task
    turns it into its own LockLost then.
    """

    def __init__(self, message: str | None = None) -> None:
        body = running_body.get()
        if message is None and isinstance(body, Body) and body.reason is not None:
            message = str(body.lost())
        super().__init__(message)


def _async_raise(thread_id: int, exception: type[BaseException]) -> None:
    """Have CPython raise ``exception`` in thread ``thread_id`` at its next bytecode."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(
        ctypes.c_ulong(thread_id), ctypes.py_object(exception)
    )


def _ran_out() -> Loss:
    """A fenced hold whose leader confirmation runs out before a check could renew it."""
    return Loss(
        LossKind.CANNOT_TELL,
        "its server's confirmation as the cluster's leader runs out before a check "
        "could renew it (the checks were held up)",
    )


def _green_library() -> str | None:
    """ "gevent" or "eventlet" when its monkey-patching made threads greenlets, else None."""
    gevent = sys.modules.get("gevent.monkey")
    if gevent is not None and gevent.is_module_patched("threading"):
        return "gevent"
    eventlet = sys.modules.get("eventlet.patcher")
    if eventlet is not None and eventlet.is_monkey_patched("thread"):
        return "eventlet"
    return None


def _native() -> tuple[Callable[..., Any], Callable[[float], None], Callable[[], int]] | None:
    """Under monkey-patching: the unpatched start_new_thread, sleep and get_ident."""
    green = _green_library()
    if green == "gevent":
        from gevent.monkey import get_original  # type: ignore[import-untyped]

        start, ident = get_original("_thread", ["start_new_thread", "get_ident"])
        return start, get_original("time", "sleep"), ident
    if green == "eventlet":
        from eventlet.patcher import original  # type: ignore[import-untyped]

        thread = original("_thread")
        return thread.start_new_thread, original("time").sleep, thread.get_ident
    return None


def _current_greenlet() -> Any:
    greenlet = sys.modules.get("greenlet")
    return greenlet.getcurrent() if greenlet is not None else None


def _where_am_i() -> tuple[weakref.ref[Any] | None, int | None]:
    """Under monkey-patching: the current greenlet (weakly: a hold keeps nothing of its
    body alive) and the ident of its OS thread."""
    native = _native()
    if native is None:
        return None, None
    return weakref.ref(_current_greenlet()), native[2]()


def _spawn(function: Callable[..., Any], *args: Any) -> None:
    """Run ``function`` in a new greenlet of the hub of this thread (never waits)."""
    if _green_library() == "gevent":
        import gevent

        gevent.spawn(function, *args)
    else:
        import eventlet

        eventlet.spawn_n(function, *args)


def _runs_its_own_code(hold: Hold, current: object | None, body: object) -> bool:
    """Whether the greenlet running now is ``hold``'s body, in its own code (not the
    library's): the one place a loss the native watch found may raise at once."""
    return (
        current is not None
        and hold._greenlet is not None
        and hold._greenlet() is current
        and isinstance(body, Body)
        and body.running
        and not body._inside
    )
