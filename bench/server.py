"""The benchmark's own Postgres: big enough for 1,000 lock sessions and 10,000 locks.

The run holds 10,000 advisory locks and opens 1,000 sessions at once: on a server
shared with others that would take most of its lock table (6,400 entries at the
defaults) and more connections than it allows (100). So, unless
``PGLOCK_BENCH_DSN`` names a server, the benchmark starts a throwaway one with the
system's Postgres binaries (the version of the local server) and
``max_connections`` of 1,100, on 127.0.0.1 over TCP like the local one.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from tasks.services import EmbeddedPostgres

MAX_CONNECTIONS = 1100


def system_bindir() -> Path | None:
    """The newest Debian-style Postgres install, if any."""
    found = sorted(
        (p for p in Path("/usr/lib/postgresql").glob("*/bin") if p.parent.name.isdigit()),
        key=lambda p: int(p.parent.name),
        reverse=True,
    )
    return next((p for p in found if (p / "initdb").exists()), None)


@contextlib.contextmanager
def bench_postgres(base: Path) -> Iterator[str]:
    """Yield the benchmark's DSN: ``PGLOCK_BENCH_DSN``, else a server of its own."""
    if os.environ.get("PGLOCK_BENCH_DSN"):
        yield os.environ["PGLOCK_BENCH_DSN"]
        return
    server = EmbeddedPostgres(base)
    server.bindir = system_bindir() or server.bindir
    server.init(f"max_connections = {MAX_CONNECTIONS}")
    server.start()
    try:
        yield server.dsn
    finally:
        server.destroy()
