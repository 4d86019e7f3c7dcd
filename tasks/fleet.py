"""The orchestrator's processes: worker replicas, beat and Flower, by pid.

Every process is started here and ended here, by its own pid (and its own
children's), never by name.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]


def celery(*args: str) -> list[str]:
    """A `celery -A tasks ...` command line for this interpreter."""
    return [sys.executable, "-m", "celery", "-A", "tasks", *args]


class Process:
    """One started process tree with a name and a log file."""

    def __init__(self, name: str, command: list[str], env: dict[str, str], log_dir: Path) -> None:
        self.name = name
        self.command = command
        self.env = {**os.environ, "PYTHONPATH": str(ROOT), **env}
        self.log = log_dir / f"{name}.log"
        self.process: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def start(self) -> None:
        with self.log.open("ab") as log:
            self.process = subprocess.Popen(
                self.command, cwd=ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT
            )
        self.starts += 1

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def tree(self) -> list[int]:
        """This process and its descendants, by pid."""
        if not self.alive() or self.pid is None:
            return []
        try:
            root = psutil.Process(self.pid)
            return [self.pid, *(child.pid for child in root.children(recursive=True))]
        except psutil.NoSuchProcess:
            return []

    def kill(self) -> None:
        """SIGKILL the whole tree at once: a crash, as chaos wants it."""
        for pid in self.tree():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.process is not None:
            self.process.wait()

    def stop(self, timeout: float = 30) -> None:
        """SIGTERM (a warm shutdown for workers), then SIGKILL of what is left."""
        if not self.alive() or self.process is None:
            return
        tree = self.tree()
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
        for pid in tree:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.process.wait()

    def log_tail(self, lines: int = 40) -> str:
        if not self.log.exists():
            return ""
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


def replica(n: int, env: dict[str, str], log_dir: Path, concurrency: int = 2) -> Process:
    """Worker replica number ``n``: prefork, task events on."""
    name = f"replica{n}"
    command = celery(
        "worker", "-n", f"{name}@%h", "-c", str(concurrency), "-E",
        "--loglevel=INFO", "--without-gossip", "--without-mingle",
    )  # fmt: skip
    return Process(name, command, env, log_dir)


def beat(name: str, env: dict[str, str], log_dir: Path) -> Process:
    schedule = log_dir / f"{name}-schedule"
    return Process(name, celery("beat", "-s", str(schedule), "--loglevel=INFO"), env, log_dir)


def flower(port: int, env: dict[str, str], log_dir: Path) -> Process:
    """Flower on 127.0.0.1; it reads FLOWER_BASIC_AUTH (user:password) itself."""
    command = celery("flower", f"--port={port}", "--address=127.0.0.1")
    return Process("flower", command, env, log_dir)
