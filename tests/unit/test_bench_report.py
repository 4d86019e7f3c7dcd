"""BENCHMARKS.md is rendered from the stored data alone, and its targets judge that data."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from bench import report

RUN_ID = "run-1"


def meta(run: str = RUN_ID, command: str = "make bench") -> dict[str, Any]:
    return {
        "run": run,
        "command": command,
        "date": "2026-12-01",
        "seconds": 12.0,
        "server": "PostgreSQL 15 of the benchmark's own",
    }


def latency(reuse_ms: float, hand_ms: float) -> dict[str, Any]:
    keys = {"floor": 0.09, "reuse": reuse_ms, "hand": hand_ms, "lease": 0.2}
    return {
        "meta": meta(),
        "count": 2000,
        "clients": 8,
        "per_client": 500,
        "rounds": 2,
        "methods": [
            {
                "key": key,
                "label": f"method {key}",
                "p50_ms": ms,
                "p99_ms": ms * 2,
                "p50_ms_clients": ms * 3,
                "p99_ms_clients": ms * 4,
            }
            for key, ms in keys.items()
        ],
        "round_p50_ms": {key: [ms, ms] for key, ms in keys.items()},
    }


def throughput() -> dict[str, Any]:
    return {
        "meta": meta(),
        "tasks_per_round": 200,
        "worker_processes": 2,
        "variants": [
            {"key": "plain", "label": "plain Celery task"},
            {"key": "reuse", "label": "TenantLockedTask, reuse (default)"},
        ],
        "rounds": [{"plain": 600.0, "reuse": 540.0}, {"plain": 500.0, "reuse": 470.0}],
        "worker_cpu_ms": {"plain": [1.6, 1.6], "reuse": [1.9, 1.9]},
        "server_cpu_ms": {"plain": [0.0, 0.0], "reuse": [0.2, 0.2]},
    }


def recovery() -> dict[str, Any]:
    return {
        "meta": meta(),
        "advisory_seconds": [0.002, 0.003, 0.004],
        "lease_ttl_seconds": 30,
        "lease_seconds": 30.0,
    }


def guard(run: str = RUN_ID) -> dict[str, Any]:
    writers = {"unguarded": "u", "guarded": "g", "hand_rolled": "h"}
    rows = [
        {"writer": w, "locks": locks, "seconds": 0.0001} for w in "ugh" for locks in (0, 10_000)
    ]
    return {
        "meta": meta(run, "python -m bench.guard"),
        "foreign_locks": 10_000,
        "rounds": 10,
        "per_round": 200,
        "hand_rolled_per_round": 20,
        "wide_per_round": 3,
        "wide_rows": 1000,
        "writers": writers,
        "one_row": rows,
        "per_row": rows,
    }


def write(folder: Path, **files: dict[str, Any]) -> Path:
    folder.mkdir(exist_ok=True)
    for name, data in files.items():
        (folder / f"{name}.json").write_text(json.dumps(data))
    return folder


def test_lock_release_within_1_15x_of_the_hand_rolled_pair_is_met() -> None:
    target = report.lock_release_target(latency(0.114, 0.100))
    assert target.met is True
    assert "0.114 ms vs 0.100 ms: 1.14x" in target.measured


def test_lock_release_beyond_1_15x_is_missed_and_says_by_how_much_and_why() -> None:
    data = latency(0.138, 0.100)
    for row, client, server in ((data["methods"][1], 30.0, 25.0), (data["methods"][2], 20, 15)):
        row.update(client_cpu_us=client, server_cpu_us=server)
    target = report.lock_release_target(data)
    assert target.met is False
    assert "1.38x" in target.measured
    assert "over by 20% of the bound" in target.row()
    assert "+38 us per cycle" in target.row()
    assert "30 vs 20 us in the client, 25 vs 15 us in the server, +20 us in all" in target.row()


def test_a_target_without_its_data_is_not_measured() -> None:
    assert report.lock_release_target(None).met is None
    assert "| not measured |" in report.lock_release_target(None).row()


def test_the_page_is_rendered_from_the_data_files_alone(tmp_path: Path) -> None:
    results = write(
        tmp_path / "results",
        run={"meta": meta(), "machine": {"machine": "x86_64", "cores": 2, "system": "Linux",
             "python": "3.11", "celery": "5", "kombu": "5", "psycopg": "3", "redis_py": "8"}},
        before=json.loads((report.RESULTS / "before.json").read_text()),
        latency=latency(0.110, 0.100),
        throughput=throughput(),
        recovery=recovery(),
        guard=guard(),
    )  # fmt: skip
    out = tmp_path / "BENCHMARKS.md"
    report.write(out, results, charts=False)
    page = out.read_text()
    # The before figures (the old core) next to this data's.
    assert "| lock+release p50, default strategy (library) | 0.120 ms | 0.110 ms |" in page
    assert "| library against the pair | 0.96x | 1.10x |" in page
    assert "93% (568 vs 608 tasks/s) | 92% (505 vs 550 tasks/s) |" in page
    assert (
        "| worker CPU per locked call (plain call) | 1.75 ms (1.60 ms) | 1.90 ms (1.60 ms) |"
        in (page)
    )
    assert "| Postgres server CPU per locked call | 0.10 ms | 0.20 ms |" in page
    # The retired Redis target is a figure now, with the reason.
    assert "a release is a release" in page
    assert "0.55x the Redis lease" in page
    # Questions without data say so; the others render their tables.
    assert "## 4. Scan fan-out and the skip path\n\nNot measured." in page
    assert "## 6. Guarded tables" in page
    assert "| advisory lock (3 rounds) | 3.0 ms | 4.0 ms |" in page


def test_a_section_measured_apart_from_the_whole_run_says_so(tmp_path: Path) -> None:
    results = write(
        tmp_path / "results",
        run={"meta": meta(), "machine": {"machine": "x86_64", "cores": 2, "system": "Linux",
             "python": "3.11", "celery": "5", "kombu": "5", "psycopg": "3", "redis_py": "8"}},
        recovery=recovery(),
        guard=guard(run="later"),
    )  # fmt: skip
    page = report.render(report.load_all(results))
    guard_section = page.split("## 6. Guarded tables")[1].split("## 7.")[0]
    assert "Measured apart by `python -m bench.guard` on 2026-12-01" in guard_section
    recovery_section = page.split("## 3.")[1].split("## 4.")[0]
    assert "Measured apart" not in recovery_section


def test_a_guarded_write_beyond_1_3x_unguarded_is_missed_with_the_guards_cost() -> None:
    data = guard()
    for row in data["one_row"]:
        row["seconds"] = {"u": 100e-6, "g": 150e-6, "h": 900e-6}[row["writer"]]
    within, flat = report.guard_targets(data)
    assert within.met is False
    assert "1.50x with no foreign lock (150 vs 100 us)" in within.measured
    assert "the guard adds 50 us" in within.row()
    assert flat.met is True


def test_a_guarded_write_within_1_3x_and_flat_meets_both_targets() -> None:
    assert [t.met for t in report.guard_targets(guard())] == [True, True]


def test_a_scale_part_kept_from_an_earlier_run_says_so(tmp_path: Path) -> None:
    scale = {
        "meta": meta(),
        "flat": None,
        "holders": {"holders": 1000, "runs": []},
        "throughput": None,
        "parts_measured": ["flat"],
    }
    page = report.render(report.load_all(write(tmp_path / "results", scale=scale)))
    assert "Its last run measured flat only; holders from an earlier run." in page
