"""A gevent hard time limit (gevent.Timeout) firing while a shared lock is taken or released.

Usage: python -m tests.support.gevent_timeout DSN NAME {acquire,release} [--kill]
Prints one JSON line: what the server and this process see afterwards.
"""

from gevent import monkey  # type: ignore[import-untyped]

monkey.patch_all()

import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import gevent  # noqa: E402

from pglock_celery import LockLost, LockUnavailable  # noqa: E402
from pglock_celery.config import PglockConfig  # noqa: E402
from pglock_celery.lock import AdvisoryLock  # noqa: E402
from pglock_celery.sources import registry  # noqa: E402
from tests.support.locks import free_elsewhere, terminate  # noqa: E402


def main() -> None:
    dsn, name, phase = sys.argv[1], sys.argv[2], sys.argv[3]
    config = PglockConfig(dsn=dsn, strategy="shared", shared_sessions=1, check_interval=0.2)
    other = AdvisoryLock(f"{name}:other", config=config)  # another holder on the session
    assert other.acquire()
    interrupted = False
    target = AdvisoryLock(name, config=config)
    for _ in range(3):  # the library's statements are prepared on second use
        assert target.acquire()
        target.release()
    for _ in range(500):
        if phase == "release":
            assert target.acquire()
        try:
            with gevent.Timeout(0.00001):  # what the gevent pool's time limit raises
                if phase == "acquire":
                    target.acquire()
                else:
                    target.release()
        except gevent.Timeout:
            interrupted = True
            break
        if phase == "acquire":
            target.release()
    time.sleep(0.3)
    report: dict[str, object] = {"interrupted": interrupted, "acquired": target.acquired}
    report["free_elsewhere"] = free_elsewhere(dsn, name)
    if "--kill" in sys.argv:  # the shared session then dies: does its other holder learn it?
        if other.backend_pid is not None:  # None once its session is gone
            terminate(dsn, other.backend_pid)
        time.sleep(1.0)  # several check intervals of "other"
    report["other_lost"] = other.lost_reason
    report["other_held"] = other.held()
    again = AdvisoryLock(name, config=config)
    try:
        report["again"] = again.acquire()
        again.release()
    except (LockUnavailable, LockLost) as exc:
        report["again"] = f"{type(exc).__name__}: {exc}"
    try:
        other.release()
    except LockLost as exc:
        report["other_release"] = str(exc)
    registry.close()
    print(json.dumps(report))


if __name__ == "__main__":
    main()
