"""A lost lock is reported once, in one text, whoever found it and under every pool.

Real `celery worker` processes (prefork and threads, started with -E) run steps whose
lock session's backend the test ends mid-step (or whose lock the step itself unlocks);
each step then meets the loss one way (tests/apps/losses.py): the monitor finds it,
the body's ``ensure_held()``, its ``lock.transaction()`` (a failed session, or its
proof on a live one), or the release. Every such call fails with a LockLost that
names the lock, gives the reason and says what to do, in the same words under both
pools; and a real Flower counts exactly one ``task-lock-lost`` event per failure.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from celery import Celery

from pglock_celery import LOCK_LOST_EVENT, LockLost
from tests.apps import losses
from tests.support.flower import fetch, running_flower
from tests.support.history import read_history
from tests.support.locks import terminate
from tests.support.services import wait_until
from tests.support.workers import Worker

POOLS = ("prefork", "threads")
FINDERS = ("monitor", "held", "transaction", "proof", "release")
#: The check interval of the workers whose monitor finds the loss, and of the others
#: (far longer than a test: there the body or the release finds it first).
WATCHING, NOT_WATCHING = 0.5, 600.0
#: Words every loss's text ends with: what to do.
ADVICE = "What to do:"


@pytest.fixture(scope="module")
def flower(worker_env: dict[str, str], log_dir: Path) -> Iterator[str]:
    with running_flower(worker_env, log_dir / "flower-loss-reports.log") as url:
        yield url


@pytest.fixture(scope="module")
def loss_workers(
    app: Celery, worker_env: dict[str, str], log_dir: Path, flower: str
) -> Iterator[dict[tuple[str, bool], tuple[Worker, str]]]:
    """One -E worker per pool and per watching (short check interval) or not, each on a
    queue of its own, all started after Flower: (pool, watching) -> (worker, queue)."""
    started: dict[tuple[str, bool], tuple[Worker, str]] = {}
    try:
        for pool in POOLS:
            for watching, interval in ((True, WATCHING), (False, NOT_WATCHING)):
                queue = f"{worker_env['PGLOCK_TEST_QUEUE']}-losses-{pool}-{watching}"
                env = {
                    **worker_env,
                    "PGLOCK_TEST_QUEUE": queue,
                    "PGLOCK_CHECK_INTERVAL": str(interval),
                }
                worker = Worker(app, "tests.apps.losses", env, log_dir, pool=pool, extra=("-E",))
                started[pool, watching] = (worker, queue)
        yield started
    finally:
        for worker, _ in started.values():
            worker.stop()


def lost_events(flower: str, worker: Worker) -> int:
    """How many task-lock-lost events Flower has counted from ``worker``."""
    counted = 0.0
    for line in fetch(f"{flower}/metrics").splitlines():
        if (
            line.startswith("flower_events_total{")
            and f'type="{LOCK_LOST_EVENT}"' in line
            and f'worker="{worker.nodename}"' in line
        ):
            counted += float(line.rsplit(" ", 1)[1])
    return int(counted)


def backend_gone(dsn: str, pid: int) -> bool:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT count(*) FROM pg_stat_activity WHERE pid = %s", (pid,))
        return row.fetchone() == (0,)


@pytest.mark.parametrize("found_by", FINDERS)
@pytest.mark.parametrize("pool", POOLS)
def test_a_lost_lock_fails_the_call_in_one_text_with_one_event(
    pool: str,
    found_by: str,
    loss_workers: dict[tuple[str, bool], tuple[Worker, str]],
    flower: str,
    history: str,
    pg_dsn: str,
    run_id: str,
) -> None:
    """Whoever finds the loss, under either pool: LockLost naming the lock, the reason and
    what to do, and exactly one task-lock-lost event in Flower."""
    worker, queue = loss_workers[pool, found_by == "monitor"]
    before = lost_events(flower, worker)
    tenant, marker = f"{run_id}-{pool}-{found_by}", f"lost:{uuid.uuid4().hex}"
    call = losses.lose.apply_async((tenant, history, marker, found_by), queue=queue)
    run = wait_until(lambda: read_history(pg_dsn, history), 30, "the step to start")[0]
    if found_by != "proof":  # there the session lives on, and only its lock goes
        assert terminate(pg_dsn, run.session_pid)
        wait_until(lambda: backend_gone(pg_dsn, run.session_pid), 10, "the backend to end")
    losses._marker().set(marker, "1", ex=60)

    with pytest.raises(LockLost) as failure:
        call.get(timeout=30)
    text = str(failure.value)
    print(f"\n{pool}, found by {found_by}: {text}")
    assert text.startswith(
        f"task {losses.lose.name}: lock tenant:{tenant} was lost during the step: "
    )
    reason = text.split("was lost during the step: ", 1)[1].split(f". {ADVICE}", 1)[0]
    assert reason and reason != "The lock is no longer held by this session"
    assert re.search(rf"\. {ADVICE} .*run again", text), text

    wait_until(
        lambda: lost_events(flower, worker) >= before + 1, 30, "Flower to count the loss", 0.2
    )
    # The failure is stored after the event was sent; Flower has it once it has the failure.
    wait_until(
        lambda: (fetch(f"{flower}/api/tasks").get(call.id) or {}).get("state") == "FAILURE",
        30,
        "Flower to see the failure",
        0.2,
    )
    assert lost_events(flower, worker) == before + 1
