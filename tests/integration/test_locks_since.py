"""`pglock-celery locks` shows since when each lock is held, not since when its session lives."""

from __future__ import annotations

import datetime as dt
import json

import psycopg

from pglock_celery.sources import registry
from tests.support.cli import cli
from tests.support.locks import lock
from tests.support.services import wait_until


def locks_json(dsn: str, prefix: str) -> list[dict[str, object]]:
    done = cli("locks", "--json", "--prefix", prefix, dsn=dsn)
    assert done.returncode == 0, done.stderr
    rows: list[dict[str, object]] = json.loads(done.stdout)
    return rows


def test_a_lock_on_a_reused_session_shows_its_own_grant_time(pg_dsn: str, run_id: str) -> None:
    name = f"since:{run_id}"
    with lock(pg_dsn, f"{name}:warm") as warm:
        backend = warm.backend_pid
    with psycopg.connect(pg_dsn, autocommit=True) as admin:
        # The idle session ages; the next lock on it is younger than it by that much.
        wait_until(
            lambda: (
                admin.execute(
                    "SELECT now() - backend_start > interval '2 s' FROM pg_stat_activity"
                    " WHERE pid = %s",
                    (backend,),
                ).fetchone()
                == (True,)
            ),
            10,
            "the idle session to be 2 s old",
        )
        held = lock(pg_dsn, name)
        before = admin.execute("SELECT now()").fetchone()[0]  # type: ignore[index]
        assert held.acquire() and held.backend_pid == backend
        after = admin.execute("SELECT now()").fetchone()[0]  # type: ignore[index]
        try:
            [row] = locks_json(pg_dsn, name)
        finally:
            held.release()
            registry.close()
    locked_at = dt.datetime.fromisoformat(str(row["locked_at"]))
    started = dt.datetime.fromisoformat(str(row["backend_start"]))
    # Whole seconds after the session opened: within a second of the grant.
    assert before - dt.timedelta(seconds=1) <= locked_at <= after
    assert locked_at - started >= dt.timedelta(seconds=2)
    assert row["age"] in ("0m00s", "0m01s")
