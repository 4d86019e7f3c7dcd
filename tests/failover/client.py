"""One client process of the failover scenarios, using the library's public API only.

It loops over the lock names with ``try_lock`` on its multi-host DSN, holds each lock
it gets for 0.5 to 2 s, writing a row to the guarded table through
``lock.transaction()`` every 0.15 s, and records in its own file (JSON lines, times
from CLOCK_MONOTONIC, which every process on this machine shares):

- ``{"grant": name, "at": t, "port": server port}``: as soon as a lock is granted;
- ``{"hold": name, "grant": t, "end": t, "how": "released" | "lost" | "error: ..."}``:
  from the grant to when it released or learned of the loss (a client stopped while
  hung in a commit never writes it: its hold stays open);
- ``{"ack": name, "seq": n, "grant": t, "at": t}``: a write whose commit returned.

Usage: python -m tests.failover.client ID DSN OUT STOPFILE NAME [NAME...]
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any, TextIO

import psycopg

from pglock_celery import LockLost, PglockError, try_lock

INSERT = "INSERT INTO fo_rows (client, name, seq, grant_t, port) VALUES (%s, %s, %s, %s, %s)"
#: The most a client runs, whatever happens to the test that started it.
MAX_SECONDS = 300


def emit(out: TextIO, record: dict[str, Any]) -> None:
    out.write(json.dumps(record) + "\n")
    out.flush()


def hold(client: int, name: str, dsn: str, out: TextIO, rng: random.Random) -> bool:
    """Try ``name`` once; hold it for a while, writing. False when it was not taken."""
    lock = try_lock(name, dsn=dsn)
    record: dict[str, Any] = {"hold": name, "client": client}
    with lock:
        if not lock.acquired:
            return False
        record["grant"] = grant = time.monotonic()
        emit(out, {"grant": name, "client": client, "at": grant, "port": lock.connection.info.port})
        try:
            until = grant + rng.uniform(0.5, 2.0)
            seq = 0
            while time.monotonic() < until:
                lock.ensure_held()
                with lock.transaction() as conn:
                    conn.execute(INSERT, (client, name, seq, grant, conn.info.port))
                emit(out, {"ack": name, "client": client, "seq": seq, "grant": grant,
                           "at": time.monotonic()})  # fmt: skip
                seq += 1
                time.sleep(0.15)  # the workload's pace between writes
            record["end"], record["how"] = time.monotonic(), "released"
        except LockLost:
            record["end"], record["how"] = time.monotonic(), "lost"
            raise
        except BaseException as exc:
            record["end"], record["how"] = time.monotonic(), f"error: {type(exc).__name__}"
            raise
        finally:
            emit(out, record)
    return True


def main(argv: list[str]) -> int:
    client, dsn, out_path, stop_path, *names = argv
    rng = random.Random(int(client))
    stop = Path(stop_path)
    began = time.monotonic()
    with open(out_path, "a") as out:
        emit(out, {"started": int(client), "pid": os.getpid(), "at": began})
        while not stop.exists() and time.monotonic() - began < MAX_SECONDS:
            for name in rng.sample(names, len(names)):
                try:
                    hold(int(client), name, dsn, out, rng)
                except (LockLost, PglockError, psycopg.Error) as exc:
                    emit(out, {"failure": type(exc).__name__, "client": int(client),
                               "at": time.monotonic()})  # fmt: skip
                    time.sleep(0.05)  # do not spin while no server answers
                if stop.exists():
                    break
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
