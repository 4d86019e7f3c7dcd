"""The doctor's budget formula, per strategy, without a server."""

from __future__ import annotations

import pytest

from pglock_celery.config import PglockConfig
from pglock_celery.doctor import Budget


@pytest.mark.parametrize(
    ("config", "total", "formula"),
    [
        (PglockConfig(), 44, "4 processes x (2 idle + 8 held) + 4 probe = 44 sessions"),
        (PglockConfig(idle_sessions=0), 36, "4 processes x (0 idle + 8 held) + 4 probe = 36"),
        (PglockConfig(strategy="connect"), 36, "4 processes x (8 held) + 4 probe = 36 sessions"),
        (PglockConfig(strategy="shared"), 20, "4 processes x (4 shared) + 4 probe = 20 sessions"),
        (
            PglockConfig(strategy="shared", shared_sessions=1),
            8,
            "4 processes x (1 shared) + 4 probe = 8 sessions",
        ),
    ],
    ids=["reuse", "reuse-no-idle", "connect", "shared", "shared-one"],
)
def test_each_strategy_counts_its_sessions_per_process_plus_one_probe(
    config: PglockConfig, total: int, formula: str
) -> None:
    found, text = Budget(4, 8).sessions(config)
    assert found == total
    assert text.startswith(formula)


def test_under_shared_the_budget_does_not_grow_with_the_concurrency() -> None:
    shared = PglockConfig(strategy="shared")
    assert Budget(4, 1).sessions(shared)[0] == Budget(4, 1000).sessions(shared)[0]


def test_one_process_is_not_plural() -> None:
    assert Budget(1, 1).sessions(PglockConfig(strategy="connect"))[1] == (
        "1 process x (1 held) + 1 probe = 2 sessions"
    )
