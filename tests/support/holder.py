"""A lock holder for the partition test, run inside a network namespace.

    python -m tests.support.holder DSN NAME idle|statement

Prints "acquired <backend pid>" once it holds the lock, then "lost <monotonic>"
when it learns the lock is gone (idle: from the lock monitor; statement: from
the failure of a long statement on the lock's connection).
"""

from __future__ import annotations

import sys
import time

import psycopg

from pglock_celery import LockLost, try_lock


def main(dsn: str, name: str, mode: str) -> int:
    lock = try_lock(name, dsn=dsn)
    try:
        with lock:
            if not lock.acquired:
                print("busy", flush=True)
                return 1
            print(f"acquired {lock.connection.info.backend_pid}", flush=True)
            try:
                if mode == "idle":
                    while True:
                        lock.sleep(0.05)
                else:
                    lock.connection.execute("SELECT pg_sleep(120)")
            except (LockLost, psycopg.Error) as exc:
                print(f"lost {time.monotonic():.3f} {type(exc).__name__}", flush=True)
                raise
    except (LockLost, psycopg.Error):
        return 0
    return 1


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:4]))
