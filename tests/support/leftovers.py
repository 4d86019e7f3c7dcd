"""What a run may leave behind on its server, counted in the run's own database only.

A `make run`, a bench or another suite on the same server keeps its sessions and
locks in databases of its own, so they never count here.
"""

from __future__ import annotations

import psycopg

LEFTOVERS = """
SELECT
  (SELECT count(*) FROM pg_stat_activity
   WHERE application_name LIKE 'pglock|%' AND pid <> pg_backend_pid()
     AND datname = current_database()),
  (SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid <> pg_backend_pid()
     AND database = (SELECT oid FROM pg_database WHERE datname = current_database()))
"""


def leftovers(dsn: str) -> tuple[int, int]:
    """Return (lock sessions, advisory locks) still present in ``dsn``'s database."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(LEFTOVERS).fetchone()
    assert row is not None
    return int(row[0]), int(row[1])
