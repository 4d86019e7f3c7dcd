"""The failover soak's pure parts: the fault schedule, the figures per failover, the verdict.

Times are binary fractions, so that the figures compare exactly.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest

from tasks.report import Summary
from tests.chaos import failover_soak, soak
from tests.chaos.failover_soak import FAILOVERS, Failover, Recovery, Schedule, recovery
from tests.chaos.mix import ORCHESTRA_FAULTS

HEALTHY = Summary(
    tenants=12, completed_cycles=40, min_cycles=3, steps=500, training_jobs=40,
    duplicate_jobs=0, repeated_submits=0, overlaps=0, stopped=0,
)  # fmt: skip
STRUCK = [Failover("switchover", 100.0, "m0", "to m1")]


def test_no_failover_comes_before_the_spacing_has_passed() -> None:
    schedule = Schedule(random.Random(1), spacing=15, start=0)
    assert {schedule.next(now) for now in range(15)} <= set(ORCHESTRA_FAULTS)
    assert schedule.next(15) in FAILOVERS


def test_the_spacing_counts_from_the_end_of_the_last_failover() -> None:
    schedule = Schedule(random.Random(1), spacing=15, start=0)
    assert schedule.next(20) in FAILOVERS
    schedule.rest(50)
    assert schedule.next(64) in ORCHESTRA_FAULTS
    assert schedule.next(65) in FAILOVERS


@pytest.mark.parametrize("seed", range(5))
def test_every_failover_kind_strikes_once_per_round(seed: int) -> None:
    schedule = Schedule(random.Random(seed), spacing=0, start=0)
    struck = [schedule.next(0) for _ in range(3 * len(FAILOVERS))]
    rounds = [struck[i : i + len(FAILOVERS)] for i in range(0, len(struck), len(FAILOVERS))]
    assert all(sorted(r) == sorted(FAILOVERS) for r in rounds)


def test_steps_that_go_on_show_no_pause() -> None:
    starts = [99.0, 100.25, 100.5, 101.0, 101.5]
    assert recovery(100, starts, until=101.75) == Recovery(0.25, 0.5, 1.0)


def test_an_outage_is_the_longest_pause_and_steps_run_again_at_its_end() -> None:
    starts = [100.25, 100.5, 121.0, 121.25, 121.5]
    got = recovery(100, starts, until=130)
    assert got == Recovery(next_step=0.25, pause=20.5, resumed=21.0)


def test_steps_that_stop_until_the_window_ends_never_ran_again() -> None:
    got = recovery(100, [100.5, 101.0], until=130)
    assert got == Recovery(next_step=0.5, pause=29.0, resumed=None)
    assert recovery(100, [90.0, 131.0], until=130) == Recovery(None, 30.0, None)


def test_the_first_other_member_seen_leading_took_over() -> None:
    changes = [(90.0, "m0"), (100.5, None), (101.0, "m0"), (103.0, None), (104.5, "m1")]
    assert failover_soak.taken_over(changes, 100, "m0", until=200) == (4.5, "m1")


def test_a_leader_that_came_back_or_a_change_after_the_window_is_no_takeover() -> None:
    changes = [(90.0, "m0"), (100.5, None), (110.0, "m0"), (150.0, "m2")]
    assert failover_soak.taken_over(changes, 100, "m0", until=140) is None


def test_a_failover_soak_with_failovers_faults_and_progress_passes() -> None:
    faults = Counter({"switchover": 1, "kill": 2})
    assert failover_soak.verdict(faults, HEALTHY, [], STRUCK) == []


def test_a_failover_soak_in_which_no_failover_struck_fails() -> None:
    assert failover_soak.verdict(Counter({"kill": 2}), HEALTHY, [], []) == [
        "no failover struck the leader: the soak tested no failover"
    ]


def test_the_soak_verdict_still_applies_under_failovers() -> None:
    assert failover_soak.verdict(Counter({"switchover": 1}), HEALTHY, ["tenant-001"], STRUCK) == [
        "1 tenants made no progress after the faults"
    ]


def test_a_strategy_without_patroni_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        soak.main(["--strategy", "connect", "--without-partition"])
    assert exit_.value.code == 2
    assert "--strategy needs --patroni" in capsys.readouterr().err
