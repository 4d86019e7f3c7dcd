"""A real Flower process tells skipped calls from calls that ran, and counts skips."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

from pglock_celery import LockLost, try_lock
from tests.apps import core
from tests.support import browser
from tests.support.flower import auth_header, fetch, running_flower
from tests.support.history import read_history
from tests.support.locks import terminate
from tests.support.services import wait_until
from tests.support.workers import ROOT, Worker

SUFFIX = "-flower"


@pytest.fixture(scope="module")
def flower(worker_env: dict[str, str], log_dir: Path) -> Iterator[str]:
    with running_flower(worker_env, log_dir / "flower.log") as url:
        yield url


@pytest.fixture(scope="module")
def events_worker(
    app: Celery, worker_env: dict[str, str], log_dir: Path, flower: str
) -> Iterator[Worker]:
    """A worker started with -E, after Flower, on a queue of its own."""
    env = {**worker_env, "PGLOCK_TEST_QUEUE": worker_env["PGLOCK_TEST_QUEUE"] + SUFFIX}
    worker = Worker(app, "tests.apps.core", env, log_dir, extra=("-E",))
    yield worker
    worker.stop()


def test_flower_shows_skips_apart_from_runs_and_counts_them(
    flower: str, events_worker: Worker, queue: str, history: str, pg_dsn: str, run_id: str
) -> None:
    busy, free = f"{run_id}-busy", f"{run_id}-free"
    with try_lock(f"tenant:{busy}", dsn=pg_dsn) as held:
        assert held.acquired
        skipped = core.step.apply_async((busy, history), queue=queue + SUFFIX)
        ran = core.step.apply_async((free, history), queue=queue + SUFFIX)
        assert skipped.get(timeout=30)["skipped"] is True
        assert ran.get(timeout=30)["ran"] is True

    def both_seen() -> dict[str, Any] | None:
        tasks = fetch(f"{flower}/api/tasks")
        done = {tid: t for tid, t in tasks.items() if t.get("state") == "SUCCESS"}
        return done if {skipped.id, ran.id} <= done.keys() else None

    seen = wait_until(both_seen, 30, "Flower to see both calls succeed", 0.2)
    print(f"\nFlower, skipped: {seen[skipped.id]['result']}")
    print(f"Flower, ran: {seen[ran.id]['result']}")
    assert seen[skipped.id]["result"].startswith("{'skipped': True, 'lock': 'tenant:")
    assert f"'lock': 'tenant:{busy}'" in seen[skipped.id]["result"]
    assert "'skipped'" not in seen[ran.id]["result"]

    def skip_counted() -> bool:
        metrics = fetch(f"{flower}/metrics")
        return any(
            "flower_events_total" in line
            and 'type="task-lock-skipped"' in line
            and not line.rstrip().endswith(" 0.0")
            for line in metrics.splitlines()
        )

    wait_until(skip_counted, 30, "Flower's metrics to count the skip", 0.2)


def test_flower_shows_a_lost_lock_as_a_failure_naming_it(
    flower: str, events_worker: Worker, queue: str, history: str, pg_dsn: str, run_id: str
) -> None:
    tenant = f"{run_id}-lost"
    step = core.chaos_step.apply_async((tenant, history, 30), queue=queue + SUFFIX)
    run = wait_until(lambda: read_history(pg_dsn, history), 30, "the step to start")[0]
    assert terminate(pg_dsn, run.session_pid)
    with pytest.raises(LockLost):
        step.get(timeout=30)

    def failure_seen() -> dict[str, Any] | None:
        task = fetch(f"{flower}/api/tasks").get(step.id)
        return task if task and task.get("state") == "FAILURE" else None

    seen = wait_until(failure_seen, 30, "Flower to see the failure", 0.2)
    print(f"\nFlower, lost lock: {seen['exception']}")
    assert "LockLost" in seen["exception"] and f"tenant:{tenant}" in seen["exception"]

    def loss_counted() -> bool:
        return any(
            'type="task-lock-lost"' in line and not line.rstrip().endswith(" 0.0")
            for line in fetch(f"{flower}/metrics").splitlines()
            if line.startswith("flower_events_total")
        )

    wait_until(loss_counted, 30, "Flower's metrics to count the loss", 0.2)


def chromium() -> Any:
    """Headless Chromium at the size the screenshots are taken."""
    return browser.chromium(
        ("--headless=new", "--no-sandbox", "--disable-gpu",
         "--disable-dev-shm-usage", "--window-size=1500,620")
    )  # fmt: skip


def test_flowers_tasks_page_in_chromium_shows_the_skip_and_the_lost_lock(
    flower: str,
    events_worker: Worker,
    queue: str,
    history: str,
    pg_dsn: str,
    run_id: str,
    log_dir: Path,
) -> None:
    """What an operator sees: the skip as SUCCESS with its result, the loss as LockLost."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    busy, lost = f"{run_id}-busy", f"{run_id}-lost"
    with try_lock(f"tenant:{busy}", dsn=pg_dsn) as held:
        assert held.acquired
        skipped = core.step.apply_async((busy, history), queue=queue + SUFFIX)
        assert skipped.get(timeout=30)["skipped"] is True
    failed = core.chaos_step.apply_async((lost, history, 30), queue=queue + SUFFIX)
    run = wait_until(lambda: read_history(pg_dsn, history), 30, "the step to start")[0]
    assert terminate(pg_dsn, run.session_pid)
    with pytest.raises(LockLost):
        failed.get(timeout=30)
    # Flower has both calls (its API) before the page is asked to show them.
    wait_until(
        lambda: {skipped.id, failed.id} <= fetch(f"{flower}/api/tasks").keys(),
        60,
        "Flower to receive both calls' events",
    )

    browser = chromium()
    try:
        # Flower asks for basic auth; the header goes with the page and its XHR calls.
        browser.execute_cdp_cmd("Network.enable", {})
        browser.execute_cdp_cmd(
            "Network.setExtraHTTPHeaders", {"headers": {"Authorization": auth_header()}}
        )

        def rows() -> dict[str, str] | None:
            """The task table's rows by task id, once both calls are in it."""
            browser.get(f"{flower}/tasks")
            search = WebDriverWait(browser, 20).until(
                lambda b: b.find_element(By.CSS_SELECTOR, "input[type=search]")
            )
            search.send_keys(run_id)
            try:
                WebDriverWait(browser, 20).until(
                    lambda b: (
                        {skipped.id, failed.id}
                        <= {
                            task_id
                            for row in b.find_elements(By.CSS_SELECTOR, "table tbody tr")
                            for task_id in (skipped.id, failed.id)
                            if task_id in row.text
                        }
                    )
                )
            except Exception:
                return None
            found = browser.find_elements(By.CSS_SELECTOR, "table tbody tr")
            return {
                task_id: row.text
                for row in found
                for task_id in (skipped.id, failed.id)
                if task_id in row.text
            }

        seen = wait_until(rows, 90, "Flower's tasks page to list both calls", 1)
        shots = {"tasks": log_dir / "flower-tasks.png"}
        browser.save_screenshot(str(shots["tasks"]))
        # Each task's own page shows its result, or its exception.
        pages = {}
        browser.set_window_size(1400, 1100)
        for name, task_id in (("skip", skipped.id), ("lost", failed.id)):
            browser.get(f"{flower}/task/{task_id}")
            pages[name] = WebDriverWait(browser, 20).until(
                lambda b, task_id=task_id: (
                    b.find_element(By.TAG_NAME, "body").text
                    if task_id in b.find_element(By.TAG_NAME, "body").text
                    else None
                )
            )
            # The screenshot shows the result (or exception) row and what follows it.
            label = browser.find_elements(
                By.XPATH,
                "//*[normalize-space(text())='Result' or normalize-space(text())='Exception']",
            )
            if label:
                browser.execute_script("arguments[0].scrollIntoView({block: 'center'})", label[0])
            shots[name] = log_dir / f"flower-{name}.png"
            browser.save_screenshot(str(shots[name]))
        if os.environ.get("PGLOCK_DOCS_SCREENSHOTS") == "1":
            for shot in shots.values():
                shutil.copy(shot, ROOT / "docs" / shot.name)
    finally:
        browser.quit()
    print(f"\nlist: {seen}\nskip page: {pages['skip']}\nlost page: {pages['lost']}\n{shots}")
    assert "SUCCESS" in seen[skipped.id] and "FAILURE" in seen[failed.id]
    assert f"{{'skipped': True, 'lock': 'tenant:{busy}', 'holder':" in pages["skip"]
    assert "LockLost" in pages["lost"] and f"lock tenant:{lost} was lost" in pages["lost"]
