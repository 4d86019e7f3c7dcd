"""A step history stamped with the server clock, and the overlap checker."""

from __future__ import annotations

import datetime as dt
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import psycopg


@dataclass(frozen=True)
class Run:
    lock_name: str
    worker_pid: int
    session_pid: int
    started: dt.datetime
    finished: dt.datetime | None


def create_history(dsn: str, table: str | None = None) -> str:
    """Create a fresh history table (named ``table``, or a new name) and return its name."""
    table = table or f"pglock_history_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            f"CREATE TABLE {table} ("
            " id bigserial PRIMARY KEY, lock_name text NOT NULL, worker_pid int NOT NULL,"
            " session_pid int NOT NULL, attempt int NOT NULL DEFAULT 0,"
            " started timestamptz NOT NULL, finished timestamptz)"
        )
        conn.execute(f"CREATE TABLE {table}_counter (lock_name text PRIMARY KEY, n int NOT NULL)")
    return table


def drop_history(dsn: str, table: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f"DROP TABLE IF EXISTS {table}, {table}_counter")


def read_history(dsn: str, table: str) -> list[Run]:
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            f"SELECT lock_name, worker_pid, session_pid, started, finished FROM {table}"
        ).fetchall()
    return [Run(*row) for row in rows]


_NEVER = dt.datetime.max.replace(tzinfo=dt.timezone.utc)

#: For an unfinished run, when its session is known to have ended (a kill, a
#: terminate, a restart), else None: the run is then open to the end of time.
SessionEnd = Callable[[Run], "dt.datetime | None"]


def counters(dsn: str, table: str) -> dict[str, int]:
    """The clock-free check: each name's read-sleep-write counter."""
    with psycopg.connect(dsn) as conn:
        return dict(conn.execute(f"SELECT lock_name, n FROM {table}_counter").fetchall())


def overlaps(runs: Iterable[Run], session_end: SessionEnd | None = None) -> list[tuple[Run, Run]]:
    """Return every pair of runs of one lock name whose intervals overlap.

    An unfinished run is open to the end of time, unless ``session_end`` knows
    when its session ended: the lock cannot outlive its session. Touching ends
    do not overlap: the next holder may start the instant the previous ended.
    """

    def _end(run: Run) -> dt.datetime:
        if run.finished is not None:
            return run.finished
        ended = session_end(run) if session_end is not None else None
        return ended if ended is not None else _NEVER

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
