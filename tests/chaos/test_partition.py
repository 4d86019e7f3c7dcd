"""G3: a holder cut off by a real network partition, idle and mid-statement."""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from pglock_celery import lock_key
from pglock_celery.config import PglockConfig
from tests.chaos.conftest import Chaos
from tests.support import netns
from tests.support.history import create_history, read_history
from tests.support.locks import free_elsewhere
from tests.support.services import EmbeddedPostgres, wait_until
from tests.support.workers import ROOT

HAND_ROLLED = """
import sys, psycopg
conn = psycopg.connect(sys.argv[1], autocommit=True)
conn.execute("SELECT pg_advisory_lock(%s)", (int(sys.argv[2]),))
print("acquired", flush=True)
sys.stdin.read()
"""


class Lines:
    """The lines a process prints, each with the monotonic time it arrived."""

    def __init__(self, process: subprocess.Popen[str]) -> None:
        self.queue: queue.Queue[tuple[float, str]] = queue.Queue()
        assert process.stdout is not None
        stream = process.stdout
        threading.Thread(target=self._read, args=(stream,), daemon=True).start()

    def _read(self, stream: object) -> None:
        for line in stream:  # type: ignore[attr-defined]
            self.queue.put((time.monotonic(), line.strip()))

    def expect(self, prefix: str, timeout: float) -> tuple[float, str]:
        deadline = time.monotonic() + timeout
        while True:
            try:
                at, line = self.queue.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no line starting {prefix!r} within {timeout} s") from None
            if line.startswith(prefix):
                return at, line


@pytest.fixture
def partition_pg(guest: netns.Guest, tmp_path: Path) -> Iterator[EmbeddedPostgres]:
    """A server that also listens on the veth pair's host side."""
    server = EmbeddedPostgres(tmp_path / "pg")
    server.init(f"listen_addresses = '127.0.0.1,{netns.HOST_IP}'")
    with (server.data / "pg_hba.conf").open("a") as hba:
        hba.write(f"host all all {netns.GUEST_IP}/32 trust\n")
    server.start()
    yield server
    server.destroy()


@pytest.mark.parametrize("mode", ["idle", "statement"])
def test_cut_off_holder_learns_first_and_the_server_frees_within_the_bound(
    guest: netns.Guest,
    partition_pg: EmbeddedPostgres,
    chaos: Chaos,
    mode: str,
    run_id: str,
) -> None:
    config = PglockConfig()
    tenant = f"{run_id}-{mode}"
    name, contrast_key = f"tenant:{tenant}", lock_key(f"hand-rolled:{tenant}")
    remote = f"host={netns.HOST_IP} port={partition_pg.port} user=postgres dbname=postgres"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    holder = subprocess.Popen(
        guest.command([sys.executable, "-m", "tests.support.holder", remote, name, mode]),
        cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    contrast = subprocess.Popen(
        guest.command([sys.executable, "-c", HAND_ROLLED, remote, str(contrast_key)]),
        cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        holder_lines, contrast_lines = Lines(holder), Lines(contrast)
        holder_lines.expect("acquired", 30)
        contrast_lines.expect("acquired", 30)
        if mode == "statement":
            wait_until(lambda: _sleeping(partition_pg.dsn), 10, "the holder's statement to run")
        cut_at = time.monotonic()
        guest.cut()
        learned_at, line = holder_lines.expect("lost", config.server_bound + 10)
        wait_until(
            lambda: free_elsewhere(partition_pg.dsn, lock_key(name)),
            config.server_bound + 10,
            "the server to free the cut-off holder's lock",
            0.1,
        )
        freed_at = time.monotonic()
        client, server = learned_at - cut_at, freed_at - cut_at
        contrast_held = not free_elsewhere(partition_pg.dsn, contrast_key)
        print(
            f"\npartition ({mode}): holder learned of the loss after {client:.1f} s"
            f" ({line.split()[-1]}), server freed the lock after {server:.1f} s"
            f" (bound {config.server_bound:.0f} s, client bound {config.client_bound:.0f} s);"
            f" a hand-rolled session with OS keepalives still holds its lock after"
            f" {time.monotonic() - cut_at:.1f} s: {contrast_held}"
            " (Linux defaults free it after about 2 h 11 min)"
        )
        assert client < server, "the server freed the lock before the holder knew it lost it"
        assert server <= config.server_bound + 2
        assert contrast_held

        # Another worker, on this side of the partition, now runs the tenant.
        table = create_history(partition_pg.dsn)
        chaos.pg = partition_pg
        chaos.worker(concurrency=1)
        result = chaos.send("chaos_step", tenant, table, 0).get(timeout=60)
        assert result["ran"] is True
        assert len(read_history(partition_pg.dsn, table)) == 1
    finally:
        for process in (holder, contrast):
            process.kill()
            process.wait()
            if process.stdout is not None:
                process.stdout.close()
        if contrast.stdin is not None:
            contrast.stdin.close()
        _terminate_application(partition_pg.dsn)


def _sleeping(dsn: str) -> bool:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity"
            " WHERE state = 'active' AND query LIKE 'SELECT pg_sleep(120)%'"
        ).fetchone()
    return bool(row and row[0])


def _terminate_application(dsn: str) -> None:
    """End the sessions the cut-off processes left behind (ours, by backend)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
            " WHERE backend_type = 'client backend' AND pid <> pg_backend_pid()"
        )
