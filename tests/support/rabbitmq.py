"""RabbitMQ for the tests: PGLOCK_TEST_AMQP, else 127.0.0.1:5672, else a throwaway node.

The throwaway node runs Debian's rabbitmq-server (installed with apt-get when the
tests run as root and it is missing) on free ports, with its own epmd, data and
cookie under the test's temporary directory; both are stopped by pid. Without
RabbitMQ the tests that need it fail under CI=true and are skipped elsewhere.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import kombu

from tasks.services import embedded_only, free_port, stop_process, wait_until

from .ci import missing

LOCAL_AMQP = "amqp://guest:guest@127.0.0.1:5672//"
SERVER = Path("/usr/lib/rabbitmq/bin/rabbitmq-server")


def amqp_answers(url: str) -> bool:
    try:
        with kombu.Connection(url, connect_timeout=2) as conn:
            conn.ensure_connection(max_retries=1, timeout=2)
        return True
    except Exception:  # refused, reset, bad credentials: not usable
        return False


def _unavailable(why: str) -> None:
    missing(f"RabbitMQ is needed and {why}")


def _install() -> None:
    """Install Debian's rabbitmq-server when we may (root with apt-get)."""
    if SERVER.exists():
        return
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        _unavailable("not installed (and we are not root with apt-get to install it)")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    # A package's own start of the service is refused: the tests start their own node.
    policy = Path("/usr/sbin/policy-rc.d")
    added_policy = not policy.exists()
    if added_policy:
        policy.write_text("#!/bin/sh\nexit 101\n")
        policy.chmod(0o755)
    try:
        subprocess.run(["apt-get", "update", "-qq"], env=env, check=False, capture_output=True)
        done = subprocess.run(
            ["apt-get", "install", "-y", "-qq", "rabbitmq-server"],
            env=env, capture_output=True, text=True, check=False,
        )  # fmt: skip
    finally:
        if added_policy:
            policy.unlink()
    if done.returncode != 0 or not SERVER.exists():
        _unavailable(f"apt-get install rabbitmq-server failed: {done.stderr.strip()[-300:]}")


class EmbeddedRabbitMQ:
    """A throwaway RabbitMQ node and its epmd, on free ports, owned by the tests."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.port = free_port()
        self.epmd_port = free_port()
        self.dist_port = free_port()
        self.processes: list[subprocess.Popen[bytes]] = []
        self.log = base / "rabbitmq.log"

    @property
    def url(self) -> str:
        return f"amqp://guest:guest@127.0.0.1:{self.port}//"

    def start(self) -> None:
        self.base.mkdir(parents=True, exist_ok=True)
        user = None
        if os.geteuid() == 0:
            user = pwd.getpwnam("rabbitmq")  # Debian's package makes it
            for parent in self.base.parents:  # let the server account reach a root-only tmp
                if parent == Path("/"):
                    break
                parent.chmod(parent.stat().st_mode | 0o011)
            os.chown(self.base, user.pw_uid, user.pw_gid)
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": str(self.base),
            "ERL_EPMD_PORT": str(self.epmd_port),
            "RABBITMQ_NODENAME": f"pglock-tests-{self.port}@localhost",
            "RABBITMQ_NODE_IP_ADDRESS": "127.0.0.1",
            "RABBITMQ_NODE_PORT": str(self.port),
            "RABBITMQ_DIST_PORT": str(self.dist_port),
            "RABBITMQ_MNESIA_BASE": str(self.base / "mnesia"),
            "RABBITMQ_LOG_BASE": str(self.base / "log"),
            "RABBITMQ_CONFIG_FILE": str(self.base / "rabbitmq"),
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(self.base / "enabled_plugins"),
            "RABBITMQ_ENABLED_PLUGINS": "",
        }
        owner: dict[str, int] = {} if user is None else {"user": user.pw_uid, "group": user.pw_gid}
        log = self.log.open("ab")
        # Our own epmd in the foreground, so that it is ours to stop.
        self.processes.append(
            subprocess.Popen(
                ["epmd", "-port", str(self.epmd_port), "-address", "127.0.0.1"],
                env=env, stdout=log, stderr=subprocess.STDOUT, **owner,  # type: ignore[arg-type]
            )
        )  # fmt: skip
        self.processes.append(
            subprocess.Popen(
                [str(SERVER)], cwd=self.base, env=env, stdout=log, stderr=subprocess.STDOUT,
                **owner,  # type: ignore[arg-type]
            )
        )  # fmt: skip
        log.close()

        def up() -> bool:
            if self.processes[-1].poll() is not None:
                raise AssertionError(f"rabbitmq-server exited; log:\n{self.log_tail()}")
            return amqp_answers(self.url)

        try:
            wait_until(up, 90, "the throwaway RabbitMQ node", 0.5)
        except BaseException:
            self.stop()
            raise

    def log_tail(self) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-30:])

    def stop(self) -> None:
        for process in reversed(self.processes):
            if process.poll() is None:
                stop_process(process, 30)
        self.processes.clear()


@contextlib.contextmanager
def rabbitmq_for_tests(base: Path) -> Iterator[str]:
    """Yield an AMQP URL: PGLOCK_TEST_AMQP, else local RabbitMQ, else a throwaway node."""
    if os.environ.get("PGLOCK_TEST_AMQP"):
        yield os.environ["PGLOCK_TEST_AMQP"]
        return
    if not embedded_only() and amqp_answers(LOCAL_AMQP):
        yield LOCAL_AMQP
        return
    _install()
    server = EmbeddedRabbitMQ(base)
    server.start()
    try:
        yield server.url
    finally:
        server.stop()


def delete_queues(url: str, *names: str) -> None:
    """Delete the tests' own queues (RabbitMQ keeps durable queues after their users)."""
    with kombu.Connection(url) as conn:
        channel = conn.default_channel
        for name in names:
            with contextlib.suppress(Exception):
                channel.queue_delete(name)
