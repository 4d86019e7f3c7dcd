"""Section 8 (shards) is rendered from its stored figures, and its targets judge them."""

from __future__ import annotations

import copy
from typing import Any

from bench import report


def shards() -> dict[str, Any]:
    """A small run of bench.shards: 3,000 locks held, every part measured."""
    return {
        "meta": {
            "run": "run-1",
            "command": "python -m bench.shards",
            "date": "2026-12-02",
            "seconds": 100.0,
            "server": "PostgreSQL 15",
        },
        "cores": 2,
        "shards": ["shard-1", "shard-2", "shard-3"],
        "idle_sessions": 2,
        "shared_sessions": 4,
        "lock_table": {
            "max_connections": 100,
            "max_prepared_transactions": 0,
            "auxiliary_backends": 22,
            "default_locks_per_transaction": 64,
            "locks_per_transaction": 64,
            "slots": 6400,
            "allocated_slots": 7808,
            "shared_memory": "143MB",
            "bytes_per_slot": 389.0,
            "needed_locks_per_transaction": 11,
        },
        "routing": {
            "shards": 3,
            "rounds": 5,
            "batch": 20000,
            "cycles": 1500,
            "cycle_p50": 200e-6,
            "cycle_one_dsn_p50": 190e-6,
            "cached": 1e-6,
            "first_placement": 6e-6,
            "shard_of": 14e-6,
        },
        "held": {
            "target": 3000,
            "held": 3000,
            "seconds": 2.0,
            "deadline": 150.0,
            "threads": 3,
            "sessions_per_shard": 16,
            "check_interval": 3600.0,
            "default_check_interval": 2.0,
            "default_shared_sessions": 4,
            "idle_backend_kb": 3000,
            "rss_before_kb": 40000,
            "rss_after_kb": 45000,
            "check_seconds": 0.0005,
            "check_sample": 100,
            "freed_seconds": 0.1,
            "errors": {},
            "shards": [
                {
                    "name": f"shard-{n}",
                    "routed": 1000,
                    "sessions": 16,
                    "locks": 1000,
                    "private_kb": 50000,
                    "rss_kb": 250000,
                }
                for n in (1, 2, 3)
            ],
            "blocks": [
                {
                    "held": 1000 * n,
                    "seconds": n,
                    "per_session": 20.0 * n,
                    "wall_us": 300.0,
                    "client_us": 200.0,
                    "server_us": 150.0 + n,
                }
                for n in (1, 2, 3)
            ],
            "server_fit": {"base": 150.0, "slope": 0.05},
            "wall_fit": {"base": 300.0, "slope": 0.0},
        },
        "throughput": {
            "processes": 4,
            "strategy": "reuse",
            "seconds": 2.0,
            "rounds": 3,
            "late_seconds": 0.0,
            "runs": [
                {"shards": n, "rate": 5000.0 + n, "client_us": 200.0, "server_us": 100.0}
                for n in (1, 2, 3)
            ],
        },
    }


def page(data: dict[str, Any] | None) -> str:
    found: dict[str, Any] = {name: None for name in report.load_all(report.RESULTS)}
    found["shards"] = data
    return report.render(found)


def section(text: str) -> str:
    return text.split("## 8. Shards")[1].split("![chart]")[0]


def test_the_section_shows_each_parts_figures() -> None:
    text = section(page(shards()))
    assert (
        "| name placed before: `previous_for_key` + `for_key` (the lock path) | 1.00 us |" in text
    )
    assert (
        "| a name's first placement: the same, rendezvous hash of 3 shards | 6.00 us | 3.00% |"
        in (text)
    )
    assert "| shard-2 | 1,000 | 16 | 1,000 | 49 MB | 244 MB |" in text
    assert "**3,000 of 3,000** in 2 s" in text
    assert "| 3 | 5,003 | 200 us | 100 us | 6,667 |" in text


def test_the_capacity_model_is_computed_from_the_figures() -> None:
    text = section(page(shards()))
    assert "100 / 2 = 50 `reuse` prefork processes, or 100 / 5 = 20 `shared` processes" in text
    assert "64 x (100 + 0) = 6,400 locks held at once" in text
    assert "1 s / 100 us = 10,000 lock cycles/s per server core" in text
    # 4 shards: 4 lock tables, 4 servers' CPU, the connections of one server unless split.
    assert "| 4 | 25,600 | 40,000 | 8.0 | 50 / 20 | 200 / 80 |" in text


def test_routing_targets_are_judged_against_two_percent_of_a_cycle() -> None:
    cached, first = report.shard_targets(shards())
    assert cached.met is True
    assert "1.00 us vs 0.200 ms: 0.50%" in cached.measured
    assert first.met is False
    assert "3.00%" in first.measured
    assert "placement is cached after" in first.row()
    rows = page(shards()).split("## Targets")[1].split("##")[0]
    assert "Routing a lock to its shard (3 shards), a name placed before" in rows


def test_a_section_never_measured_says_so() -> None:
    text = page(None)
    assert "## 8. Shards\n\nNot measured." in text
    assert all(t.met is None for t in report.shard_targets(None))
    assert "| Routing a lock to its shard (3 shards), a name placed before" in text


def test_a_missing_part_renders_a_not_measured_line() -> None:
    data = copy.deepcopy(shards())
    del data["held"]
    text = section(page(data))
    assert "### 8b. Locks held at once over three shards\n\nNot measured:" in text
    assert "### 8d. Capacity model\n\nNot measured: it needs the figures of 8b." in text
    assert "| 3 | 5,003 |" in text  # the parts measured still render


def test_a_fill_cut_short_is_extrapolated_and_says_so() -> None:
    data = copy.deepcopy(shards())
    data["held"].update(held=1500, target=3000)
    text = section(page(data))
    assert "**Not all held**: 1,500 of 3,000 within the deadline" in text
    assert "These are extrapolations, not measurements." in text
