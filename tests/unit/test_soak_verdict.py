"""`make soak` passes only when faults hit the system and it kept working."""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest

from tasks.report import Summary
from tests.chaos import soak

HEALTHY = Summary(
    tenants=12, completed_cycles=40, min_cycles=3, steps=500, training_jobs=40,
    duplicate_jobs=0, repeated_submits=0, overlaps=0, stopped=0,
)  # fmt: skip
FAULTS = Counter({"kill": 3, "terminate": 2})


def test_a_soak_with_faults_and_progress_passes() -> None:
    assert soak.verdict(FAULTS, HEALTHY, []) == []


def test_a_soak_in_which_no_fault_hit_anything_fails() -> None:
    assert soak.verdict(Counter(), HEALTHY, []) == [
        "no fault hit anything: the soak tested nothing"
    ]


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        ({"steps": 0}, "no step ran"),
        ({"overlaps": 1}, "1 overlapping steps"),
        ({"duplicate_jobs": 2}, "2 duplicate training jobs"),
    ],
)
def test_each_broken_guarantee_fails_the_soak(change: dict[str, int], problem: str) -> None:
    assert soak.verdict(FAULTS, dataclasses.replace(HEALTHY, **change), []) == [problem]


def test_a_tenant_without_progress_fails_the_soak() -> None:
    assert soak.verdict(FAULTS, HEALTHY, ["tenant-003"]) == [
        "1 tenants made no progress after the faults"
    ]


def test_without_namespaces_the_soak_refuses_to_start_unless_told(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(soak.netns, "available", lambda: "network namespaces need root")
    assert soak.main(["--duration", "1"]) == 2
    assert "--without-partition" in capsys.readouterr().err
