"""A test host in a network namespace, joined to this one by a veth pair, that can be cut off.

Only addresses of our own namespace and veth pair are used; nothing leaves the machine.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Sequence

HOST_IP = "10.213.77.1"
GUEST_IP = "10.213.77.2"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True)


def available() -> str | None:
    """None when namespaces can be made here, else why not."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "the ip command (iproute2) is missing"
    return None


class Guest:
    """A namespace reachable at GUEST_IP; this side of the pair is HOST_IP."""

    def __init__(self) -> None:
        tag = f"{os.getpid() % 100000}"
        self.namespace = f"pglock{tag}"
        self.host_link = f"pglh{tag}"
        self.guest_link = f"pgln{tag}"

    def create(self) -> None:
        _ip("netns", "add", self.namespace)
        _ip("link", "add", self.host_link, "type", "veth", "peer", "name", self.guest_link)
        _ip("link", "set", self.guest_link, "netns", self.namespace)
        _ip("addr", "add", f"{HOST_IP}/30", "dev", self.host_link)
        _ip("link", "set", self.host_link, "up")
        self.exec_ip("addr", "add", f"{GUEST_IP}/30", "dev", self.guest_link)
        self.exec_ip("link", "set", self.guest_link, "up")
        self.exec_ip("link", "set", "lo", "up")

    def exec_ip(self, *args: str) -> None:
        _ip("netns", "exec", self.namespace, "ip", *args)

    def command(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside the namespace."""
        return ["ip", "netns", "exec", self.namespace, *argv]

    def cut(self) -> None:
        """Partition: packets both ways are dropped silently, nobody is told."""
        self.exec_ip("route", "add", "blackhole", f"{HOST_IP}/32")
        _ip("route", "add", "blackhole", f"{GUEST_IP}/32")

    def stop_answering(self) -> None:
        """This side goes silent: the guest's packets arrive, no reply ever leaves.

        The guest's own sends still succeed, so it sees a host that never answers
        (rather than the immediate error a blackhole route on its side would give).
        """
        _ip("route", "add", "blackhole", f"{GUEST_IP}/32")

    def heal(self) -> None:
        self.exec_ip("route", "del", "blackhole", f"{HOST_IP}/32")
        _ip("route", "del", "blackhole", f"{GUEST_IP}/32", check=False)

    def destroy(self) -> None:
        _ip("route", "del", "blackhole", f"{GUEST_IP}/32", check=False)
        _ip("link", "del", self.host_link, check=False)
        _ip("netns", "del", self.namespace, check=False)
