"""The core's bookkeeping against fakes: holds, losses, the monitor, bodies, the fork barrier.

No server: a fake source (check, end_use, monitor) stands in for sources/, any object for
a hold's session, so each state is reached in milliseconds. Every wait polls against a
deadline; the real-server suites prove the same guarantees end to end.
"""

from __future__ import annotations

import itertools
import logging
import sys
import threading
import time
import types
from collections.abc import Callable
from typing import Any

import pytest

import pglock_celery.sources as sources_module
from pglock_celery.config import PglockConfig
from pglock_celery.exceptions import LockLost
from pglock_celery.leader import Confirmation, Standing
from pglock_celery.loss import Loss, LossKind, lock_gone, session_ended
from pglock_celery.monitor import Body, Hold, Monitor
from pglock_celery.shield import library_code
from pglock_celery.sources import Registry
from pglock_celery.sources.base import Source

#: The longest any test waits for something that should come (it comes in milliseconds).
DEADLINE = 2.0


def eventually(condition: Callable[[], bool], within: float = DEADLINE) -> bool:
    """Poll ``condition`` until it is true or ``within`` seconds have passed."""
    until = time.monotonic() + within
    while True:
        if condition():
            return True
        if time.monotonic() >= until:
            return False
        time.sleep(0.002)


class FakeSource:
    """What a hold needs of its source: a scripted check, and a record of every call."""

    def __init__(
        self,
        monitor: Monitor | None = None,
        check: Callable[[Hold], Loss | None] | None = None,
        calls: list[tuple[str, Any]] | None = None,
    ) -> None:
        self.monitor = monitor if monitor is not None else Monitor()
        self._check = check
        self.calls: list[tuple[str, Any]] = calls if calls is not None else []
        self.checked: list[tuple[Hold, float, threading.Thread]] = []

    def check(self, hold: Hold) -> Loss | None:
        self.checked.append((hold, time.monotonic(), threading.current_thread()))
        return self._check(hold) if self._check is not None else None

    def end_use(self, hold: Hold, loss: Loss) -> None:
        self.calls.append(("end_use", loss))

    def check_interval(self, hold: Hold) -> float:
        return hold.config.check_interval

    def confirmed_until(self, hold: Hold) -> float | None:
        return self.fenced_until

    #: What confirmed_until answers (None: not fenced).
    fenced_until: float | None = None

    def checks_of(self, hold: Hold) -> int:
        return sum(1 for checked, _, _ in list(self.checked) if checked is hold)


def make_hold(
    source: FakeSource,
    *,
    granted: bool = True,
    check_interval: float = 2.0,
    on_lost: Callable[[Hold, Loss], None] | None = None,
    label: str = "tenant:1",
) -> Hold:
    hold = Hold(
        source,  # type: ignore[arg-type]
        key=1,
        label=label,
        application_name="pglock test",
        task_id=None,
        config=PglockConfig(dsn="dbname=x", check_interval=check_interval),
        on_lost=on_lost,
    )
    hold.session = types.SimpleNamespace()  # type: ignore[assignment]
    hold.granted = granted
    return hold


def quick_monitor() -> Monitor:
    """A monitor whose idle checker threads end soon (none lingers into another test)."""
    monitor = Monitor()
    monitor.CHECKER_IDLE = 0.1  # type: ignore[misc]
    return monitor


# Hold.mark_lost


def test_mark_lost_records_the_loss_once() -> None:
    """A second loss changes nothing: the first is kept, end_use and the handler ran once."""
    told: list[Loss] = []
    source = FakeSource()
    hold = make_hold(source, on_lost=lambda h, loss: told.append(loss))
    first, second = session_ended("cut"), lock_gone("unlocked")
    hold.mark_lost(first)
    hold.mark_lost(second)
    assert hold.lost is first
    assert source.calls == [("end_use", first)]
    assert told == [first]
    assert source.monitor.losses == {"while_held": 1, "at_release": 0}


def test_mark_lost_after_end_does_nothing() -> None:
    told: list[Loss] = []
    source = FakeSource()
    hold = make_hold(source, on_lost=lambda h, loss: told.append(loss))
    hold.end()
    hold.mark_lost(session_ended("too late"))
    assert hold.lost is None
    assert source.calls == []
    assert told == []
    assert source.monitor.losses["while_held"] == 0


def test_mark_lost_without_a_session_does_nothing() -> None:
    """A hold whose source never found a session has nothing to lose."""
    told: list[Loss] = []
    source = FakeSource()
    hold = make_hold(source, on_lost=lambda h, loss: told.append(loss))
    hold.session = None
    hold.mark_lost(session_ended("never opened"))
    assert hold.lost is None
    assert source.calls == []
    assert told == []


def test_mark_lost_ends_the_use_of_the_session_before_telling_the_holder() -> None:
    calls: list[tuple[str, Any]] = []
    source = FakeSource(calls=calls)

    def on_lost(hold: Hold, loss: Loss) -> None:
        # The holder is told with the loss already recorded on its hold.
        calls.append(("told", hold.lost))

    hold = make_hold(source, on_lost=on_lost)
    loss = session_ended("the server closed it")
    hold.mark_lost(loss)
    assert calls == [("end_use", loss), ("told", loss)]


def test_mark_lost_of_a_wait_cut_short_ends_the_use_but_tells_nobody() -> None:
    """A hold not granted yet is only cut off: end_use runs, no handler, no loss counted."""
    told: list[Loss] = []
    source = FakeSource()
    hold = make_hold(source, granted=False, on_lost=lambda h, loss: told.append(loss))
    loss = session_ended("cut while waiting")
    hold.mark_lost(loss)
    assert hold.lost is loss
    assert source.calls == [("end_use", loss)]
    assert told == []
    assert source.monitor.losses == {"while_held": 0, "at_release": 0}
    assert hold.wait(0) is True


def test_mark_lost_counts_a_loss_while_held() -> None:
    source = FakeSource()
    for n in range(3):
        make_hold(source).mark_lost(lock_gone(f"gone {n}"))
    assert source.monitor.losses == {"while_held": 3, "at_release": 0}


def test_wait_returns_true_once_lost() -> None:
    hold = make_hold(FakeSource())
    assert hold.wait(0.01) is False
    hold.mark_lost(lock_gone("gone"))
    assert hold.wait(0) is True


def test_wait_is_woken_by_a_loss_from_another_thread() -> None:
    hold = make_hold(FakeSource())
    woke: list[bool] = []
    waiter = threading.Thread(target=lambda: woke.append(hold.wait(DEADLINE * 5)))
    waiter.start()
    assert eventually(lambda: hold._changed is not None)
    started = time.monotonic()
    hold.mark_lost(session_ended("cut"))
    waiter.join(DEADLINE)
    assert woke == [True]
    assert time.monotonic() - started < DEADLINE


def test_wait_returns_true_once_ended() -> None:
    hold = make_hold(FakeSource())
    hold.end()
    assert hold.wait(0) is True


# Loss


@pytest.mark.parametrize("kind", list(LossKind))
def test_only_a_lock_gone_leaves_the_session_to_its_other_locks(kind: LossKind) -> None:
    assert Loss(kind, "why").takes_the_session is (kind is not LossKind.LOCK_GONE)


def test_a_loss_reads_as_its_detail() -> None:
    assert str(Loss(LossKind.NOT_LEADER, "deposed at 09:00")) == "deposed at 09:00"
    assert str(session_ended("the server closed it")) == "the server closed it"


def test_loss_helpers_choose_the_kind() -> None:
    assert session_ended("a").kind is LossKind.SESSION_ENDED
    assert lock_gone("b").kind is LossKind.LOCK_GONE


# Monitor


def test_monitor_marks_a_hold_lost_once_it_has_lasted_its_check_interval() -> None:
    loss = session_ended("the server closed it")
    told: list[Loss] = []
    monitor = quick_monitor()
    source = FakeSource(monitor, check=lambda hold: loss)
    hold = make_hold(source, check_interval=0.05, on_lost=lambda h, found: told.append(found))
    monitor.watch(hold)
    try:
        assert hold.wait(DEADLINE), "the monitor did not find the loss in time"
    finally:
        monitor.unwatch(hold)
    assert hold.lost is loss
    assert eventually(lambda: told == [loss])
    assert source.calls == [("end_use", loss)]
    assert monitor.losses["while_held"] == 1
    _, first_check, thread = source.checked[0]
    assert first_check >= hold.since + 0.05
    assert thread is not threading.current_thread()


def test_monitor_keeps_checking_a_held_lock_every_interval() -> None:
    monitor = quick_monitor()
    source = FakeSource(monitor)
    hold = make_hold(source, check_interval=0.02)
    monitor.watch(hold)
    try:
        assert eventually(lambda: source.checks_of(hold) >= 3)
    finally:
        monitor.unwatch(hold)
    assert hold.lost is None
    times = [at for checked, at, _ in list(source.checked) if checked is hold]
    # Each check comes at least an interval after the previous one ended.
    assert all(later - earlier >= 0.02 for earlier, later in itertools.pairwise(times))


def test_a_hold_unwatched_before_its_first_check_is_never_checked() -> None:
    monitor = quick_monitor()
    source = FakeSource(monitor)
    early = make_hold(source, check_interval=0.03, label="early")
    monitor.watch(early)
    monitor.unwatch(early)
    # Watched after it, with the same interval: its first check is due later.
    later = make_hold(source, check_interval=0.03, label="later")
    monitor.watch(later)
    try:
        assert eventually(lambda: source.checks_of(later) >= 2)
    finally:
        monitor.unwatch(later)
    assert source.checks_of(early) == 0


def test_an_ended_hold_still_watched_is_not_checked() -> None:
    """A hold ended (released) a moment before its unwatch is never asked about."""
    monitor = quick_monitor()
    source = FakeSource(monitor)
    ended = make_hold(source, check_interval=0.02, label="ended")
    ended.end()
    monitor.watch(ended)
    control = make_hold(source, check_interval=0.02, label="control")
    monitor.watch(control)
    try:
        assert eventually(lambda: source.checks_of(control) >= 2)
    finally:
        monitor.unwatch(ended)
        monitor.unwatch(control)
    assert source.checks_of(ended) == 0


def test_a_failing_check_is_logged_and_the_monitor_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    monitor = quick_monitor()
    loss = lock_gone("gone")

    def check(hold: Hold) -> Loss | None:
        if hold.label == "broken":
            raise RuntimeError("the fake check broke")
        return loss

    source = FakeSource(monitor, check=check)
    broken = make_hold(source, check_interval=0.02, label="broken")
    caplog.set_level(logging.ERROR, logger="pglock_celery.lock")
    monitor.watch(broken)
    try:
        assert eventually(lambda: source.checks_of(broken) >= 1)
        healthy = make_hold(source, check_interval=0.02, label="healthy")
        monitor.watch(healthy)
        try:
            assert healthy.wait(DEADLINE), "a later hold was not checked"
            # The hold whose check failed is checked again, not dropped.
            assert eventually(lambda: source.checks_of(broken) >= 2)
        finally:
            monitor.unwatch(healthy)
    finally:
        monitor.unwatch(broken)
    assert healthy.lost is loss
    assert broken.lost is None
    failures = [r for r in caplog.records if "the loss check failed" in r.getMessage()]
    assert failures, "the failing check was not logged"
    assert failures[0].exc_info is not None
    assert isinstance(failures[0].exc_info[1], RuntimeError)
    assert "broken" in failures[0].getMessage()


def test_checker_threads_are_bounded_whatever_the_number_of_holds() -> None:
    """20 holds whose checks all hang use at most MAX_CHECKERS checker threads."""
    monitor = quick_monitor()
    unblock = threading.Event()

    def hang(hold: Hold) -> None:
        unblock.wait(DEADLINE * 5)

    source = FakeSource(monitor, check=hang)
    holds = [make_hold(source, check_interval=0.02, label=f"tenant:{n}") for n in range(20)]

    def checker_threads() -> set[threading.Thread]:
        return {thread for _, _, thread in list(source.checked)}

    before = {t for t in threading.enumerate() if t.name == "pglock-check"}
    for hold in holds:
        monitor.watch(hold)
    try:
        assert eventually(lambda: len(checker_threads()) >= Monitor.MAX_CHECKERS)
        # Passes go on meanwhile (every 5 ms): any thread beyond the bound would start.
        seen_most = 0
        until = time.monotonic() + 0.1
        while time.monotonic() < until:
            new = {t for t in threading.enumerate() if t.name == "pglock-check"} - before
            seen_most = max(seen_most, len(new))
            time.sleep(0.005)
        assert len(checker_threads()) == Monitor.MAX_CHECKERS
        assert all(t.name == "pglock-check" for t in checker_threads())
        assert seen_most <= Monitor.MAX_CHECKERS
        assert len(source.checked) == Monitor.MAX_CHECKERS  # the others wait their turn
    finally:
        for hold in holds:
            hold.end()
            monitor.unwatch(hold)
        unblock.set()


# Body and shield.library_code


class BodyThread:
    """Run ``steps(body, record)`` as a body in a thread of its own; what it did is kept."""

    def __init__(self, steps: Callable[[Body, dict[str, Any]], None]) -> None:
        self.record: dict[str, Any] = {}
        self._steps = steps
        self.thread = threading.Thread(target=self._run, name="a body")
        self.thread.start()

    def _run(self) -> None:
        record = self.record
        try:
            body = Body("tenant:1", Monitor())
            body.start()
            record["body"] = body
            try:
                self._steps(body, record)
            finally:
                body.end()
        except LockLost as exc:
            record["raised"] = exc
        record["done"] = True

    def wait_for(self, key: str) -> None:
        assert eventually(lambda: key in self.record), f"the body never reached {key!r}"

    def join(self) -> dict[str, Any]:
        self.thread.join(DEADLINE * 2)
        assert not self.thread.is_alive(), "the body never ended"
        return self.record


def spin_until(record: dict[str, Any], key: str, within: float = DEADLINE) -> None:
    """A Python loop (bytecode, no blocking call) until ``key`` is recorded."""
    until = time.monotonic() + within
    while key not in record and time.monotonic() < until:
        pass


def spin(seconds: float) -> None:
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        pass


def last_frame_name(exc: BaseException) -> str:
    tb = exc.__traceback__
    assert tb is not None
    while tb.tb_next is not None:
        tb = tb.tb_next
    return tb.tb_frame.f_code.co_name


def test_interrupt_raises_lock_lost_inside_a_running_body() -> None:
    def steps(body: Body, record: dict[str, Any]) -> None:
        until = time.monotonic() + DEADLINE
        while time.monotonic() < until:
            record["looping"] = True
        record["ran_out"] = True

    runner = BodyThread(steps)
    runner.wait_for("looping")
    started = time.monotonic()
    assert runner.record["body"].interrupt("the server closed it") is True
    record = runner.join()
    assert "ran_out" not in record, "the body ran to its end: it was not interrupted"
    assert isinstance(record["raised"], LockLost)
    assert time.monotonic() - started < 1.0
    assert record["body"].reason == "the server closed it"


def test_an_interrupt_from_the_body_itself_sends_nothing() -> None:
    """Found by the body itself (held()): it returns True, the body runs on unharmed."""

    def steps(body: Body, record: dict[str, Any]) -> None:
        record["returned"] = body.interrupt("found by held()")
        spin(0.05)  # an exception sent would land at the next bytecode
        record["ran_on"] = True

    record = BodyThread(steps).join()
    assert record["returned"] is True
    assert record["ran_on"] is True
    assert "raised" not in record
    assert record["body"].reason == "found by held()"


def test_an_interrupt_inside_library_code_waits_for_the_outermost_block_to_end() -> None:
    def steps(body: Body, record: dict[str, Any]) -> None:
        with library_code():
            with library_code():
                record["inside"] = True
                spin_until(record, "interrupted")
                spin(0.02)  # nothing lands inside the library's code
            record["after_inner"] = True
            spin(0.02)  # nor between the inner block and the outer one's end
            record["before_outer_exit"] = True
        record["after_outer"] = True

    runner = BodyThread(steps)
    runner.wait_for("inside")
    assert runner.record["body"].interrupt("lost meanwhile") is True
    runner.record["interrupted"] = True
    record = runner.join()
    assert record["after_inner"] is True
    assert record["before_outer_exit"] is True
    assert "after_outer" not in record
    assert isinstance(record["raised"], LockLost)
    assert last_frame_name(record["raised"]) == "leave_library"


def test_an_interrupt_sent_as_the_body_enters_library_code_never_lands_inside_it() -> None:
    """Decided while the body waits to enter (its mutex taken): the block runs whole or not."""

    def steps(body: Body, record: dict[str, Any]) -> None:
        spin_until(record, "go")
        record["entering"] = True
        with library_code():
            record["inside"] = True
            spin(0.02)
            record["block_done"] = True
        record["after"] = True

    runner = BodyThread(steps)
    runner.wait_for("body")
    body = runner.record["body"]
    with body._mutex:  # the body's enter_library waits for it
        runner.record["go"] = True

        def waiting_to_enter() -> bool:
            frame = sys._current_frames().get(runner.thread.ident or 0)
            return frame is not None and frame.f_code.co_name == "enter_library"

        assert eventually(waiting_to_enter)
        assert body.interrupt("lost as it entered") is True
    record = runner.join()
    assert isinstance(record.get("raised"), LockLost)
    assert "after" not in record
    assert "inside" not in record or "block_done" in record, "raised inside library code"


def test_library_code_outside_a_body_does_nothing() -> None:
    with library_code(), library_code():
        pass


def test_nothing_is_raised_after_the_body_ended() -> None:
    def steps(body: Body, record: dict[str, Any]) -> None:
        body.end()
        record["ended"] = True
        spin_until(record, "interrupted")
        spin(0.05)
        record["ran_on"] = True

    runner = BodyThread(steps)
    runner.wait_for("ended")
    assert runner.record["body"].interrupt("too late") is False
    runner.record["interrupted"] = True
    record = runner.join()
    assert record["ran_on"] is True
    assert "raised" not in record


def test_an_interrupt_held_back_is_dropped_when_the_body_ends_inside_library_code() -> None:
    """A body that returns while the library's code runs is not raised into afterwards."""

    def steps(body: Body, record: dict[str, Any]) -> None:
        with library_code():
            record["inside"] = True
            spin_until(record, "interrupted")
            body.end()
        record["after_outer"] = True

    runner = BodyThread(steps)
    runner.wait_for("inside")
    assert runner.record["body"].interrupt("lost meanwhile") is True
    runner.record["interrupted"] = True
    record = runner.join()
    assert record["after_outer"] is True
    assert "raised" not in record


def test_a_second_interrupt_does_nothing() -> None:
    def steps(body: Body, record: dict[str, Any]) -> None:
        try:
            until = time.monotonic() + DEADLINE
            while time.monotonic() < until:
                record["looping"] = True
        except LockLost as exc:
            record["first"] = exc
        spin_until(record, "second_sent")
        spin(0.05)
        record["ran_on"] = True

    runner = BodyThread(steps)
    runner.wait_for("looping")
    body = runner.record["body"]
    assert body.interrupt("first loss") is True
    runner.wait_for("first")
    assert body.interrupt("second loss") is False
    runner.record["second_sent"] = True
    record = runner.join()
    assert record["ran_on"] is True
    assert "raised" not in record
    assert body.reason == "first loss"
    assert isinstance(record["first"], LockLost)


# Registry: the fork barrier


@pytest.fixture
def config() -> PglockConfig:
    return PglockConfig(dsn="dbname=x")


class Opener:
    """A thread inside ``registry.opening(config)`` until told to leave."""

    def __init__(self, registry: Registry, config: PglockConfig) -> None:
        self.inside = threading.Event()
        self.leave = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(registry, config))
        self.thread.start()
        assert self.inside.wait(DEADLINE)

    def _run(self, registry: Registry, config: PglockConfig) -> None:
        with registry.opening(config):
            self.inside.set()
            self.leave.wait(DEADLINE * 5)

    def finish(self) -> None:
        self.leave.set()
        self.thread.join(DEADLINE)
        assert not self.thread.is_alive()


def test_before_fork_returns_at_once_when_nothing_is_being_opened(config: PglockConfig) -> None:
    registry = Registry()
    with registry.opening(config):
        pass
    started = time.monotonic()
    registry._before_fork()
    try:
        assert time.monotonic() - started < 0.1
    finally:
        registry._after_fork_in_parent()


def test_before_fork_waits_for_an_open_and_returns_as_it_ends(config: PglockConfig) -> None:
    registry = Registry()
    opener = Opener(registry, config)
    returned = threading.Event()
    returned_at: list[float] = []

    def fork() -> None:
        registry._before_fork()
        returned_at.append(time.monotonic())
        returned.set()
        registry._after_fork_in_parent()  # in the thread that holds the barrier

    forker = threading.Thread(target=fork)
    try:
        forker.start()
        assert not returned.wait(0.05), "the fork did not wait for the open"
    finally:
        ended_at = time.monotonic()
        opener.finish()
    assert returned.wait(DEADLINE)
    forker.join(DEADLINE)
    assert returned_at[0] - ended_at < 0.2


def test_before_fork_waits_no_longer_than_the_open_can_take(
    config: PglockConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An open that outlives its bound (session.open_bound) holds a fork up to that bound."""
    monkeypatch.setattr(sources_module, "open_bound", lambda config: 0.3)
    registry = Registry()
    started = time.monotonic()
    opener = Opener(registry, config)
    try:
        registry._before_fork()
        try:
            waited = time.monotonic() - started
            assert opener.thread.is_alive()  # the open never ended
        finally:
            registry._after_fork_in_parent()
    finally:
        opener.finish()
    assert 0.3 <= waited < 1.0


def test_before_fork_waits_for_the_longest_of_several_opens(
    config: PglockConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With two opens under way, the fork waits for both, and the later deadline."""
    bounds = iter([0.05, 0.15])
    monkeypatch.setattr(sources_module, "open_bound", lambda config: next(bounds))
    registry = Registry()
    started = time.monotonic()
    openers = [Opener(registry, config), Opener(registry, config)]
    try:
        registry._before_fork()
        try:
            waited = time.monotonic() - started
        finally:
            registry._after_fork_in_parent()
    finally:
        for opener in openers:
            opener.finish()
    assert 0.15 <= waited < 0.9


# Source.check: the leader first, then the hold, then the session


class FakeRegistry:
    def __init__(self) -> None:
        self.monitor = Monitor()

    def opening(self, config: PglockConfig) -> Any:
        raise AssertionError("no session is opened here")


class CheckOnly(Source):
    """A source with Source.check as written and nothing else."""

    def acquire(self, hold: Hold, *, wait: bool, timeout: float | None) -> bool:
        raise NotImplementedError

    def release(self, hold: Hold, *, clean: bool) -> None:
        raise NotImplementedError

    def connection(self, hold: Hold) -> Any:
        raise NotImplementedError

    def transaction(self, hold: Hold) -> Any:
        raise NotImplementedError

    def end_use(self, hold: Hold, loss: Loss) -> None:
        pass

    def close(self) -> None:
        pass


class UntouchableGuard:
    def acquire(self, blocking: bool = True) -> bool:
        raise AssertionError("the session was asked")


class FakeFence:
    name = "the test's cluster"
    longest_ask = 3.0

    def __init__(self, confirmation: Confirmation) -> None:
        self.confirmation = confirmation

    def confirm(self, server: Any, *, fresh_for: float = 0.0) -> Confirmation:
        return self.confirmation

    def check_interval(self, wanted: float) -> float:
        return wanted


def check_only(config: PglockConfig, fence: FakeFence | None = None) -> CheckOnly:
    source = CheckOnly(config, FakeRegistry())
    source.fence = fence  # type: ignore[assignment]
    return source


def closed_session() -> Any:
    return types.SimpleNamespace(closed=True, identity=object(), guard=UntouchableGuard())


def fake_hold(source: CheckOnly, session: Any) -> Hold:
    hold = make_hold(FakeSource(source.monitor))
    hold.source = source
    hold.session = session
    return hold


def test_check_asks_the_leader_before_anything_else(config: PglockConfig) -> None:
    """A deposed server is NOT_LEADER, even for a hold already lost or a closed session."""
    fence = FakeFence(
        Confirmation(leader=False, until=0.0, reason="B leads", standing=Standing.NOT_LEADER)
    )
    source = check_only(config, fence)
    hold = fake_hold(source, closed_session())
    hold.lost = lock_gone("earlier")
    loss = source.check(hold)
    assert loss is not None
    assert loss.kind is LossKind.NOT_LEADER
    assert "B leads" in loss.detail


def test_check_cannot_tell_when_the_leader_does_not_answer(config: PglockConfig) -> None:
    fence = FakeFence(Confirmation(leader=False, until=0.0, reason="no answer"))
    source = check_only(config, fence)
    loss = source.check(fake_hold(source, closed_session()))
    assert loss is not None
    assert loss.kind is LossKind.CANNOT_TELL


def test_check_of_a_lost_hold_returns_its_loss_without_asking_the_session(
    config: PglockConfig,
) -> None:
    source = check_only(config)
    hold = fake_hold(source, closed_session())
    hold.lost = earlier = lock_gone("earlier")
    assert source.check(hold) is earlier


def test_check_of_a_closed_session_is_a_session_ended(config: PglockConfig) -> None:
    source = check_only(config)
    loss = source.check(fake_hold(source, closed_session()))
    assert loss is not None
    assert loss.kind is LossKind.SESSION_ENDED
    assert loss.takes_the_session


def test_a_fenced_hold_whose_checks_are_held_up_is_lost_before_its_confirmation_ends() -> None:
    """Every check stuck (a frozen server's probe ahead of it, a trickling Patroni): the
    hold's leader confirmation runs out all the same, and the monitor finds it lost
    before its end without waiting for any check."""
    monitor = quick_monitor()
    unstuck = threading.Event()

    def stuck(hold: Hold) -> Loss | None:
        unstuck.wait(30)
        return None

    source = FakeSource(monitor, check=stuck)
    told: list[tuple[float, Loss]] = []
    hold = make_hold(
        source, check_interval=0.1, on_lost=lambda h, loss: told.append((time.monotonic(), loss))
    )
    source.fenced_until = time.monotonic() + 0.5
    monitor.watch(hold)
    try:
        assert eventually(lambda: bool(told), 5), "the hold was not found lost"
        at, loss = told[0]
        assert at <= source.fenced_until  # before the window closes
        assert loss.kind is LossKind.CANNOT_TELL and "runs out" in loss.detail
        assert ("end_use", loss) in source.calls
    finally:
        unstuck.set()
        monitor.unwatch(hold)


def test_a_fenced_hold_whose_checks_renew_its_confirmation_is_kept() -> None:
    monitor = quick_monitor()

    def renew(hold: Hold) -> Loss | None:
        source.fenced_until = time.monotonic() + 0.5
        return None

    source = FakeSource(monitor, check=renew)
    source.fenced_until = time.monotonic() + 0.5
    hold = make_hold(source, check_interval=0.1)
    monitor.watch(hold)
    try:
        kept_until = time.monotonic() + 1.5  # three confirmations' worth
        while time.monotonic() < kept_until:
            assert hold.lost is None, hold.lost
            time.sleep(0.05)  # time has to pass: the checks renew meanwhile
        assert source.checks_of(hold) >= 5
    finally:
        monitor.unwatch(hold)
