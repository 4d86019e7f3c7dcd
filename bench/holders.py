"""A process of lock holders for the scale section: greenlets, each holding a lock of its own.

    python -m bench.holders DSN STRATEGY COUNT PREFIX

The library alone, without Celery: COUNT greenlets of one gevent process each take
``bench-holders:<PREFIX>:<pid>:<n>`` under STRATEGY, with PREFIX as the sessions'
``pglock_application_name``. Prints ``held N`` once every greenlet holds its lock
or failed (N < COUNT then, each distinct error on stderr with its count), keeps the
locks until a line comes on stdin, then releases them and prints ``released``; ends
with its stdin (its idle sessions open until then).
"""

from __future__ import annotations

import os
import sys


def main(argv: list[str]) -> int:
    from gevent import monkey

    monkey.patch_all()

    import gevent
    import gevent.event

    from pglock_celery.config import PglockConfig
    from pglock_celery.lock import AdvisoryLock

    dsn, strategy, count, prefix = argv[0], argv[1], int(argv[2]), argv[3]
    config = PglockConfig(dsn=dsn, strategy=strategy, application_name=prefix)
    release = gevent.event.Event()
    held: list[int] = []
    errors: dict[str, int] = {}

    def hold(n: int) -> None:
        try:
            with AdvisoryLock(f"bench-holders:{prefix}:{os.getpid()}:{n}", config=config) as lock:
                if not lock.acquired:
                    raise RuntimeError("the lock was not free")
                held.append(n)
                release.wait()
        except Exception as exc:
            errors[repr(exc)] = errors.get(repr(exc), 0) + 1

    greenlets = [gevent.spawn(hold, n) for n in range(count)]
    while len(held) + sum(errors.values()) < count:
        gevent.sleep(0.05)
    for error, times in errors.items():
        print(f"{times} x {error}", file=sys.stderr, flush=True)
    print(f"held {len(held)}", flush=True)
    gevent.get_hub().threadpool.apply(sys.stdin.readline)
    release.set()
    gevent.joinall(greenlets)
    print("released", flush=True)
    gevent.get_hub().threadpool.apply(sys.stdin.read)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
