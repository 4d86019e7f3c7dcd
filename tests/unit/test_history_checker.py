"""The overlap checker the integration and chaos tests rely on must be able to fail."""

from __future__ import annotations

import datetime as dt

from tests.support.history import Run, overlaps

T0 = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)


def run(name: str, start: float, end: float | None, pid: int = 1) -> Run:
    finished = T0 + dt.timedelta(seconds=end) if end is not None else None
    return Run(name, pid, pid, T0 + dt.timedelta(seconds=start), finished)


def test_overlapping_runs_of_one_name_are_found() -> None:
    a, b = run("t", 0, 2), run("t", 1, 3)
    assert overlaps([b, a]) == [(a, b)]


def test_touching_runs_and_other_names_do_not_overlap() -> None:
    assert overlaps([run("t", 0, 1), run("t", 1, 2), run("u", 0.5, 1.5)]) == []


def test_a_run_inside_a_long_one_is_found_after_a_short_one() -> None:
    long, short, inner = run("t", 0, 10), run("t", 1, 2), run("t", 5, 6)
    assert overlaps([long, short, inner]) == [(long, short), (long, inner)]


def test_an_unfinished_run_is_open_to_the_end() -> None:
    open_run, later = run("t", 0, None), run("t", 100, 101)
    assert overlaps([open_run, later]) == [(open_run, later)]


def test_a_known_session_end_closes_an_unfinished_run() -> None:
    killed, later = run("t", 0, None, pid=7), run("t", 5, 6)
    assert overlaps([killed, later], lambda r: T0 + dt.timedelta(seconds=4)) == []
    assert overlaps([killed, later], lambda r: T0 + dt.timedelta(seconds=5.5)) != []
