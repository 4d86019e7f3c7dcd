"""A step history stamped with the server clock, and the overlap checker."""

from __future__ import annotations

import datetime as dt
import uuid
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

import psycopg


@dataclass(frozen=True)
class Run:
    lock_name: str
    worker_pid: int
    session_pid: int
    started: dt.datetime
    finished: dt.datetime | None


def create_history(dsn: str) -> str:
    """Create a fresh history table and return its name."""
    table = f"pglock_history_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            f"CREATE TABLE {table} ("
            " id bigserial PRIMARY KEY, lock_name text NOT NULL, worker_pid int NOT NULL,"
            " session_pid int NOT NULL, attempt int NOT NULL DEFAULT 0,"
            " started timestamptz NOT NULL, finished timestamptz)"
        )
    return table


def drop_history(dsn: str, table: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f"DROP TABLE IF EXISTS {table}")


def read_history(dsn: str, table: str) -> list[Run]:
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            f"SELECT lock_name, worker_pid, session_pid, started, finished FROM {table}"
        ).fetchall()
    return [Run(*row) for row in rows]


_NEVER = dt.datetime.max.replace(tzinfo=dt.timezone.utc)


def _end(run: Run) -> dt.datetime:
    return run.finished if run.finished is not None else _NEVER


def overlaps(runs: Iterable[Run]) -> list[tuple[Run, Run]]:
    """Return every pair of runs of one lock name whose intervals overlap.

    An unfinished run is open to the end of time. Touching ends do not
    overlap: the next holder may start the instant the previous one ended.
    """
    by_name: dict[str, list[Run]] = defaultdict(list)
    for run in runs:
        by_name[run.lock_name].append(run)
    found: list[tuple[Run, Run]] = []
    for same_name in by_name.values():
        same_name.sort(key=lambda run: run.started)
        latest: Run | None = None  # the run that ends last so far
        for run in same_name:
            if latest is not None and run.started < _end(latest):
                found.append((latest, run))
            if latest is None or _end(run) > _end(latest):
                latest = run
    return found
