"""A locked task inside Celery's canvas, on real workers: self.replace() and chains.

The workers fixture runs two prefork workers of two processes each, so what one
call publishes is picked up at once by another process.
"""

from __future__ import annotations

from typing import Any

from tests.apps import core
from tests.helpers.workers import Worker


def test_a_replacement_runs_because_the_lock_is_released_before_it_is_sent(
    workers: list[Worker], history: str, run_id: str
) -> None:
    result = core.replace_self.delay(f"replace-{run_id}", history)
    answer: Any = result.get(timeout=60)
    assert answer.get("stage") == "second", answer  # not {"skipped": True, ...}
    assert answer["ran"] is True
