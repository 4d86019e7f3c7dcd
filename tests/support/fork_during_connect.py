"""A holder process that forks while another of its threads opens the lock session.

Usage: python -m tests.support.fork_during_connect DSN NAME

Prints the pids of the forked children (each sleeps 30 s), then "held" once the
lock is taken, then kills itself with SIGKILL: a holder that dies.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

from pglock_celery.config import PglockConfig
from pglock_celery.lock import AdvisoryLock


def main() -> None:
    dsn, name = sys.argv[1], sys.argv[2]
    lock = AdvisoryLock(name, config=PglockConfig(dsn=dsn, strategy="connect"))
    done = threading.Event()
    result: list[bool] = []

    def take() -> None:
        result.append(lock.acquire())
        done.set()

    children: list[int] = []
    thread = threading.Thread(target=take)
    thread.start()
    # The main thread forks now and then (a multiprocessing pool growing, a subprocess
    # helper) while the other thread is opening its lock session.
    while not done.is_set() and len(children) < 50:
        pid = os.fork()
        if pid == 0:
            os.close(1)  # the test reads the holder's stdout to its end
            time.sleep(30)
            os._exit(0)
        children.append(pid)
        time.sleep(0.0005)
    thread.join()
    print(" ".join(map(str, children)), flush=True)
    print("held" if result == [True] else "not held", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    main()
