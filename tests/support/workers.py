"""Start and stop real `celery worker` processes for the tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import psutil
from celery import Celery

from .services import wait_until

ROOT = Path(__file__).resolve().parents[2]


class Worker:
    """One `celery worker` process tree, started and stopped by a test."""

    def __init__(
        self,
        app: Celery,
        module: str,
        env: dict[str, str],
        log_dir: Path,
        *,
        pool: str = "prefork",
        concurrency: int = 2,
        extra: tuple[str, ...] = (),
    ) -> None:
        self.app = app
        self.pool = pool
        self.nodename = f"w{uuid.uuid4().hex[:8]}@pglock-tests"
        self.log = log_dir / f"{self.nodename.split('@')[0]}.log"
        command = [
            sys.executable, "-m", "celery", "-A", module, "worker",
            "-n", self.nodename, "-P", pool, "-c", str(concurrency),
            "-Q", env["PGLOCK_TEST_QUEUE"], "--loglevel=INFO",
            "--without-gossip", "--without-mingle", "--without-heartbeat",
            "--prefetch-multiplier=1", *extra,
        ]  # fmt: skip
        self._log_file = self.log.open("wb")
        self.process = subprocess.Popen(
            command,
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT), **env},
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
        )
        try:
            wait_until(self._answers, 60, f"worker {self.nodename} to answer a ping")
        except BaseException as exc:
            self.stop()  # never leave a half-started worker behind
            raise AssertionError(f"worker did not start ({exc}); log:\n{self.log_tail()}") from exc

    def _answers(self) -> bool:
        if self.process.poll() is not None:
            raise AssertionError(f"worker exited early; log:\n{self.log_tail()}")
        try:
            return bool(self.app.control.ping(destination=[self.nodename], timeout=0.5))
        except Exception:  # a broker connection from before a broker restart: try again
            return False

    @property
    def pid(self) -> int:
        return self.process.pid

    def children(self) -> list[int]:
        try:
            return [child.pid for child in psutil.Process(self.pid).children()]
        except psutil.NoSuchProcess:
            return []

    def log_tail(self, lines: int = 60) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        """Warm shutdown, then SIGKILL of this worker's own tree if it hangs."""
        if self.process.poll() is None:
            tree = self.children()
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                for pid in [self.pid, *tree]:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                self.process.wait()
        self._log_file.close()
