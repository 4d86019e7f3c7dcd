"""docs/getting-started.md runs as written: its first example shows a skip.

The snippets are read from the page itself, so the page and this test cannot drift:
the ``# pipelines.py`` blocks become that file (with the run's Redis and Postgres in
place of the page's URLs), the SQL blocks run on the run's database, and each ``celery``
and ``python`` line of the shell blocks runs as a real process (``celery ... &``: a
real ``celery worker`` in the background, with a node name added so that it can be
pinged). The other Python blocks run in this process with ``DSN`` set.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import psutil
import psycopg
import pytest
from celery import Celery

from tests.support.services import wait_until

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "getting-started.md"
#: What the page writes for the services; the test puts the run's own in their place.
PAGE_BROKER = '"redis://localhost:6379/0"'
PAGE_DSN = '"postgresql://app@db/pipelines"'
FENCE = re.compile(r"^```(\w+)\n(.*?)^```\s*$", re.MULTILINE | re.DOTALL)


def blocks(language: str) -> list[str]:
    """The page's fenced blocks in ``language``, in page order."""
    return [body for lang, body in FENCE.findall(PAGE.read_text()) if lang == language]


def module_source(broker_url: str, pg_dsn: str) -> str:
    """pipelines.py as the page builds it, on the run's services."""
    parts = [block for block in blocks("python") if block.startswith("# pipelines.py")]
    assert parts, "the page has no # pipelines.py block"
    source = "\n".join(parts)
    assert source.count(PAGE_BROKER) == 2 and source.count(PAGE_DSN) == 1, source
    return source.replace(PAGE_BROKER, repr(broker_url)).replace(PAGE_DSN, repr(pg_dsn))


def commands() -> list[list[str]]:
    """The page's shell lines that start a worker or run Python, split as a shell would."""
    found = []
    for block in blocks("sh"):
        for line in block.splitlines():
            words = shlex.split(line, comments=True)
            if words[:1] in (["celery"], ["python"]):
                found.append(words)
    return found


class Worker:
    """A page's `celery ... worker ... &` line, run as a real worker process tree."""

    def __init__(self, words: list[str], cwd: Path, env: dict[str, str], probe: Celery) -> None:
        assert words[-1] == "&" and "worker" in words, words
        self.name = f"getting-started-{uuid.uuid4().hex[:8]}@pglock-tests"
        self.log = cwd / f"{self.name.split('@')[0]}.log"
        command = [sys.executable, "-m", *words[:-1], "-n", self.name]
        with self.log.open("wb") as log:
            self.process = subprocess.Popen(
                command, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT
            )
        self.probe = probe

    def answers(self) -> bool:
        if self.process.poll() is not None:
            raise AssertionError(f"the worker exited: {self.log.read_text()[-3000:]}")
        return bool(self.probe.control.ping(destination=[self.name], timeout=0.5))

    def stop(self) -> None:
        """Warm shutdown; SIGKILL of its own tree if it hangs."""
        if self.process.poll() is not None:
            return
        tree = [child.pid for child in psutil.Process(self.process.pid).children(recursive=True)]
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(20)
        except subprocess.TimeoutExpired:
            for pid in [self.process.pid, *tree]:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            self.process.wait()


@pytest.fixture
def pipeline_table(pg_dsn: str) -> Iterator[None]:
    """The page's SQL blocks, run on the run's database; the table goes afterwards."""
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        for block in blocks("sql"):
            conn.execute(block)  # type: ignore[call-overload]
    yield
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("DROP TABLE IF EXISTS pipeline")


def test_the_getting_started_page_runs_and_its_first_example_shows_a_skip(
    pg_dsn: str, broker_url: str, tmp_path: Path, pipeline_table: None
) -> None:
    (tmp_path / "pipelines.py").write_text(module_source(broker_url, pg_dsn))
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    probe = Celery("getting-started-probe", broker=broker_url)
    workers: list[Worker] = []
    outputs: list[list[str]] = []
    try:
        for words in commands():
            if words[0] == "celery":
                workers.append(Worker(words, tmp_path, env, probe))
                continue
            for worker in workers:
                wait_until(worker.answers, 60, f"worker {worker.name} to answer a ping")
            done = subprocess.run(
                [sys.executable, *words[1:]],
                cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
            )  # fmt: skip
            assert done.returncode == 0, done.stderr
            outputs.append(done.stdout.splitlines())
    finally:
        for worker in workers:
            worker.stop()
    assert len(workers) == 2 and len(outputs) == 2, (workers, outputs)

    # The first example: one call ran, the other was skipped, in either order.
    first = sorted(outputs[0])
    assert len(first) == 2 and first[0] == "advanced tenant 42", outputs[0]
    assert first[1].startswith("{'skipped': True, 'lock': 'training:42', 'holder': "), first
    shown = blocks("text")[0]
    assert "advanced tenant 42" in shown and "{'skipped': True, 'lock': 'training:42'" in shown

    # The fenced write committed under the lock.
    assert outputs[1] == ["submitted"]
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        row = conn.execute("SELECT stage FROM pipeline WHERE tenant = 42").fetchone()
    assert row == ("submitted",)


def test_the_pages_code_outside_a_task_runs(pg_dsn: str) -> None:
    others = [block for block in blocks("python") if not block.startswith("# pipelines.py")]
    assert others, "the page's try_lock / wait_lock example is gone"
    for block in others:
        exec(compile(block, str(PAGE), "exec"), {"DSN": pg_dsn})
