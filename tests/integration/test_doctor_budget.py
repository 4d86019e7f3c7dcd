"""The doctor's connection budget: the most sessions a fleet of worker processes may open
on each shard (``--processes``, ``--concurrency``, the strategy's own sessions and one
probe per process), against that server's free connections."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator

import psycopg
import pytest
from celery import Celery

from pglock_celery.cli import main
from pglock_celery.config import PglockConfig
from pglock_celery.doctor import Budget, check_budget
from tests.support.services import EmbeddedPostgres, own_database

#: The small server's max_connections: every free connection is counted exactly.
SMALL_CONNECTIONS = 20
FIGURES = re.compile(
    r"= (\d+) sessions .*; (-?\d+) free"
    r" \(max_connections (\d+) - (\d+) reserved - (\d+) in use\)"
)


@pytest.fixture(scope="module")
def three(pg_dsn: str) -> Iterator[dict[str, str]]:
    with own_database(pg_dsn) as a, own_database(pg_dsn) as b, own_database(pg_dsn) as c:
        yield {"a": a, "b": b, "c": c}


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A server of the test's own, so that nobody else's sessions change what is free."""
    server = EmbeddedPostgres(tmp_path_factory.mktemp("small-connections"))
    server.init(f"max_connections = {SMALL_CONNECTIONS}")
    server.start()
    yield server.dsn
    server.destroy()


def doctor(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PGLOCK_")}
    return subprocess.run(
        [sys.executable, "-m", "pglock_celery.cli", "-A", "tests.apps.bare:app", "doctor", *args],
        env={**clean, **env}, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def budget_of(done: subprocess.CompletedProcess[str]) -> list[dict[str, str]]:
    assert done.returncode in (0, 1), done.stderr
    return [f for f in json.loads(done.stdout) if f["check"] == "budget"]


def figures(message: str) -> tuple[int, int, int, int, int]:
    """Sessions, free, max_connections, reserved and in use, as the finding gives them."""
    found = FIGURES.search(message)
    assert found is not None, message
    total, free, limit, reserved, used = (int(n) for n in found.groups())
    assert free == limit - reserved - used
    return total, free, limit, reserved, used


def alone_on(dsn: str) -> psycopg.Connection:
    """A session on ``dsn``'s server once it is the only client session there."""
    conn = psycopg.connect(dsn, autocommit=True)
    deadline = time.monotonic() + 10
    query = "SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend'"
    while (row := conn.execute(query).fetchone()) is not None and row[0] != 1:
        assert time.monotonic() < deadline, "other sessions stay on the test's own server"
        time.sleep(0.05)
    return conn


def test_a_fleet_that_fits_the_free_connections_is_ok(pg_dsn: str) -> None:
    done = doctor("--dsn", pg_dsn, "--json", "--processes", "1", "--concurrency", "1",
                  PGLOCK_STRATEGY="connect")  # fmt: skip
    [finding] = budget_of(done)
    assert finding["message"].startswith("1 process x (1 held) + 1 probe = 2 sessions (connect); ")
    total, free, *_ = figures(finding["message"])
    assert total <= free
    assert (finding["level"], finding["fix"]) == ("ok", "")
    assert finding["message"].endswith(": fits")


@pytest.mark.parametrize(
    ("processes", "concurrency", "level"),
    [(8, 1, "ok"), (1, 16, "fail"), (5, 2, "ok")],
    ids=["exactly-free", "one-above-free", "below-free"],
)
def test_the_budget_fails_from_one_session_above_the_free_connections(
    small: str, processes: int, concurrency: int, level: str
) -> None:
    """connect: processes x (concurrency + 1 probe); free: 20 - 3 reserved - the test's own."""
    with alone_on(small) as conn:
        [finding] = check_budget(
            conn, Budget(processes, concurrency), PglockConfig(strategy="connect")
        )
    total, free, limit, reserved, used = figures(finding.message)
    assert (limit, used) == (SMALL_CONNECTIONS, 1)
    assert free == 16 == SMALL_CONNECTIONS - reserved - 1
    assert total == processes * (concurrency + 1)
    assert finding.level == level, finding
    if level == "fail":
        assert finding.message.endswith(f": {total - free} more than free")
        assert f"raise max_connections to at least {total + reserved + used}" in finding.fix


def test_a_fleet_above_the_free_connections_fails_with_its_figures_and_what_to_do(
    pg_dsn: str,
) -> None:
    with psycopg.connect(pg_dsn) as conn:
        row = conn.execute("SELECT current_setting('max_connections')::int").fetchone()
    assert row is not None
    processes = row[0]  # 4 sessions each: more than the server has at all
    done = doctor("--dsn", pg_dsn, "--json", "--processes", str(processes), "--concurrency", "1")
    [finding] = budget_of(done)
    assert done.returncode == 1
    assert finding["level"] == "fail"
    total, free, _, reserved, used = figures(finding["message"])
    assert total == processes * (2 + 1) + processes
    assert finding["message"].startswith(
        f"{processes} processes x (2 idle + 1 held) + {processes} probe = {total} sessions (reuse)"
    )
    assert finding["message"].endswith(f": {total - free} more than free")
    fix = finding["fix"]
    assert f"raise max_connections to at least {total + reserved + used}" in fix
    assert "lower pglock_idle_sessions (now 2)" in fix
    assert "pglock_strategy = 'shared'" in fix


@pytest.mark.parametrize(
    ("strategy", "formula"),
    [
        ("reuse", "3 processes x (3 idle + 8 held) + 3 probe = 36 sessions (reuse)"),
        ("connect", "3 processes x (8 held) + 3 probe = 27 sessions (connect)"),
        ("shared", "3 processes x (5 shared) + 3 probe = 18 sessions (shared)"),
    ],
)
def test_each_strategy_counts_its_own_sessions_from_its_settings(
    pg_dsn: str, strategy: str, formula: str
) -> None:
    """reuse: idle_sessions + held; connect: held; shared: shared_sessions; each + 1 probe."""
    done = doctor(
        "--dsn", pg_dsn, "--json", "--processes", "3", "--concurrency", "8",
        PGLOCK_STRATEGY=strategy, PGLOCK_IDLE_SESSIONS="3", PGLOCK_SHARED_SESSIONS="5",
    )  # fmt: skip
    [finding] = budget_of(done)
    assert finding["message"].startswith(f"{formula}; "), finding
    total, free, *_ = figures(finding["message"])
    assert finding["level"] == ("ok" if total <= free else "fail")


def test_every_shard_gets_a_finding_with_the_whole_fleets_budget(three: dict[str, str]) -> None:
    done = doctor(
        "--json", "--processes", "2", "--concurrency", "4", PGLOCK_SHARDS=json.dumps(three)
    )
    found = budget_of(done)
    assert sorted(f["shard"] for f in found) == ["a", "b", "c"]
    for finding in found:
        assert finding["message"].startswith(
            "2 processes x (2 idle + 4 held) + 2 probe = 14 sessions (reuse); "
        ), finding


def test_the_text_report_gives_each_shard_its_budget_line(three: dict[str, str]) -> None:
    done = doctor("--processes", "2", "--concurrency", "4", PGLOCK_SHARDS=json.dumps(three))
    assert done.returncode in (0, 1), done.stderr
    lines = done.stdout.splitlines()
    heads = [i for i, line in enumerate(lines) if line.startswith("shard ")]
    budgets = [i for i, line in enumerate(lines) if " budget: 2 processes x " in line]
    assert len(heads) == len(budgets) == 3
    assert all(head < budget for head, budget in zip(heads, budgets, strict=True))


def test_the_concurrency_defaults_to_the_apps_worker_concurrency(
    pg_dsn: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in list(os.environ):
        if name.startswith("PGLOCK_"):
            monkeypatch.delenv(name)
    app = Celery("budget", set_as_current=False)
    app.conf.update(worker_concurrency=6, pglock_strategy="connect")
    code = main(["doctor", "--dsn", pg_dsn, "--json", "--processes", "2"], app=app)
    [finding] = [f for f in json.loads(capsys.readouterr().out) if f["check"] == "budget"]
    assert code in (0, 1)
    assert finding["message"].startswith(
        "2 processes x (6 held) + 2 probe = 14 sessions (connect, concurrency from "
        "worker_concurrency); "
    ), finding


def test_lock_sessions_alone_still_checks_the_connections_without_a_budget(pg_dsn: str) -> None:
    done = doctor("--dsn", pg_dsn, "--json", "--lock-sessions", "100000")
    findings = json.loads(done.stdout)
    [connections] = [f for f in findings if f["check"] == "connections"]
    assert done.returncode == 1
    assert connections["level"] == "fail"
    assert "fewer than the 100000 lock sessions" in connections["message"]
    assert not [f for f in findings if f["check"] == "budget"]


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--processes", "4"], "--processes needs --concurrency"),
        (["--concurrency", "4"], "--concurrency needs --processes"),
        (["--processes", "4", "--concurrency", "4", "--lock-sessions", "10"],
         "--lock-sessions or --processes: give one or the other"),
        (["--processes", "4", "--lock-sessions", "0"], "--lock-sessions or --processes"),
        (["--processes", "0", "--concurrency", "4"], "argument --processes: 0 is not at least 1"),
        (["--processes", "-3", "--concurrency", "4"], "argument --processes: -3 is not at least"),
        (["--processes", "4", "--concurrency", "0"], "argument --concurrency: 0 is not at least"),
        (["--processes", "x", "--concurrency", "4"], "--processes: 'x' is not a whole number"),
    ],
)  # fmt: skip
def test_a_budget_half_given_combined_or_not_a_count_is_a_usage_error(
    pg_dsn: str, args: list[str], said: str
) -> None:
    done = doctor("--dsn", pg_dsn, *args)
    assert done.returncode == 2
    assert said in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
    assert done.stdout == ""  # refused before any check ran
