"""The doctor's connection budget: the sessions a fleet of worker processes may open on
each shard (``--processes``, ``--concurrency``, and the strategy's own sessions),
against that server's connection slots."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator

import pytest

from tests.support.services import own_database, scalar


@pytest.fixture(scope="module")
def three(pg_dsn: str) -> Iterator[dict[str, str]]:
    with own_database(pg_dsn) as a, own_database(pg_dsn) as b, own_database(pg_dsn) as c:
        yield {"a": a, "b": b, "c": c}


def doctor(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PGLOCK_")}
    return subprocess.run(
        [sys.executable, "-m", "pglock_celery.cli", "-A", "tests.apps.bare:app", "doctor", *args],
        env={**clean, **env}, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def budget_of(done: subprocess.CompletedProcess[str]) -> list[dict[str, str]]:
    assert done.returncode in (0, 1), done.stderr
    return [f for f in json.loads(done.stdout) if f["check"] == "budget"]


def slots(dsn: str) -> int:
    return int(
        scalar(
            dsn,
            "SELECT current_setting('max_connections')::int"
            " - current_setting('superuser_reserved_connections')::int",
        )
    )


@pytest.mark.parametrize(
    ("strategy", "each"),
    [("reuse", "2 idle + 8 held + 1 probe"), ("connect", "8 held + 1 probe"),
     ("shared", "4 shared + 1 probe")],
)  # fmt: skip
def test_each_strategy_counts_its_own_sessions_per_process(
    pg_dsn: str, strategy: str, each: str
) -> None:
    done = doctor(
        "--dsn", pg_dsn, "--json", "--processes", "3", "--concurrency", "8",
        PGLOCK_STRATEGY=strategy,
    )  # fmt: skip
    [finding] = budget_of(done)
    per_process = sum(int(n) for n in re.findall(r"\d+", each))
    assert finding["level"] in ("ok", "warn")
    assert finding["message"].startswith(
        f"3 processes x ({each}) = {3 * per_process} sessions ({strategy}); {slots(pg_dsn)} slots"
    ), finding


def test_a_fleet_beyond_the_servers_slots_fails_with_its_figures(pg_dsn: str) -> None:
    processes = slots(pg_dsn)  # each needs more than one session
    done = doctor("--dsn", pg_dsn, "--json", "--processes", str(processes), "--concurrency", "1")
    [finding] = budget_of(done)
    assert done.returncode == 1
    assert finding["level"] == "fail"
    total = processes * (2 + 1 + 1)
    assert f"= {total} sessions" in finding["message"]
    reserved = int(scalar(pg_dsn, "SELECT current_setting('superuser_reserved_connections')"))
    assert f"max_connections to at least {total + reserved}" in finding["fix"]


def test_every_shard_gets_the_whole_fleets_budget(three: dict[str, str]) -> None:
    done = doctor(
        "--json", "--processes", "2", "--concurrency", "4", PGLOCK_SHARDS=json.dumps(three)
    )
    found = budget_of(done)
    assert sorted(f["shard"] for f in found) == ["a", "b", "c"]
    assert all(
        f["message"].startswith("2 processes x (2 idle + 4 held + 1 probe) = 14") for f in found
    )


@pytest.mark.parametrize(
    "args",
    [["--processes", "4"], ["--concurrency", "4"],
     ["--processes", "4", "--concurrency", "4", "--lock-sessions", "10"],
     ["--processes", "0", "--concurrency", "4"], ["--processes", "x", "--concurrency", "4"]],
)  # fmt: skip
def test_a_budget_half_given_or_not_a_count_is_bad_input(pg_dsn: str, args: list[str]) -> None:
    done = doctor("--dsn", pg_dsn, *args)
    assert done.returncode == 2
    assert re.search(r"--processes|--concurrency|--lock-sessions", done.stderr), done.stderr
    assert "Traceback" not in done.stderr
