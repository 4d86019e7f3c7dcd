"""A real Flower for the tests: started on a free port with basic auth, asked over HTTP."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tests.support.services import free_port, wait_until
from tests.support.workers import ROOT

#: Flower's basic auth in the tests (user:password).
AUTH = "ops:flower-test-pw"


def auth_header() -> str:
    """The Authorization header's value for AUTH."""
    return f"Basic {base64.b64encode(AUTH.encode()).decode()}"


def fetch(url: str) -> Any:
    """GET ``url`` from Flower: JSON decoded, anything else as text."""
    request = urllib.request.Request(url, headers={"Authorization": auth_header()})
    with urllib.request.urlopen(request, timeout=5) as response:
        body = response.read().decode()
    return json.loads(body) if response.headers.get_content_type() == "application/json" else body


@contextlib.contextmanager
def running_flower(worker_env: dict[str, str], log: Path) -> Iterator[str]:
    """``celery -A tests.apps.core flower`` with the workers' environment; its URL."""
    port = free_port()
    with log.open("wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "tests.apps.core", "flower",
             f"--port={port}", "--address=127.0.0.1"],
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT), "FLOWER_BASIC_AUTH": AUTH, **worker_env},
            stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
        url = f"http://127.0.0.1:{port}"

        def answers() -> bool:
            try:
                return fetch(f"{url}/healthcheck") == "OK"
            except OSError:
                return False

        try:
            wait_until(answers, 30, "Flower")
            yield url
        finally:
            process.send_signal(signal.SIGTERM)
            process.wait(15)
