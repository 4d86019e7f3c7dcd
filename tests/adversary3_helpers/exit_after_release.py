"""A short-lived process (a cron script, a worker child at its max-tasks-per-child)
whose lock was lost before its release, and which ends right after the release.

Usage: python -m tests.adversary3_helpers.exit_after_release DSN NAME
Logs at ERROR to stderr (what the library reports), prints "released" once the
release returned, then ends normally (a LockLost from the release ends it with a
traceback instead).
"""

from __future__ import annotations

import logging
import os
import sys

from pglock_celery import sessions
from pglock_celery.config import PglockConfig
from pglock_celery.lock import AdvisoryLock


def main() -> None:
    logging.basicConfig(level=logging.ERROR, stream=sys.stderr)
    dsn, name = sys.argv[1], sys.argv[2]
    config = PglockConfig(dsn=dsn, strategy="reuse")
    for _ in range(2):  # a process past its first locks: the unlock is prepared
        with AdvisoryLock(f"warm:{os.getpid()}", config=config) as warm:
            assert warm.acquired
    assert sessions.idle_count() == 1
    # A LockLost from the release ends the script with a traceback (a report too).
    with AdvisoryLock(name, config=config, task_id="task-exit") as held:
        assert held.acquired
        # The lock goes before its release (behind the library's back, on its own
        # connection, as tests/integration/test_unwaited_unlock.py does).
        assert held._session is not None
        held._session.conn.execute("SELECT pg_advisory_unlock_all()")
    print("released", flush=True)


if __name__ == "__main__":
    main()
