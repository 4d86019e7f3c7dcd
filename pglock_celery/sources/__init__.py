"""Where lock sessions come from: one interface, two implementations, one registry.

A :class:`Source` gives a lock a session and takes it back: ``acquire`` (find a
session and try the lock on it), ``release`` (unlock, wait for the server to
free it, let the session go), ``check`` (is the lock still held?), ``close``.
The lock (lock.py) only ever talks to this interface:

- :class:`~.dedicated.DedicatedSource`: a session to itself for each holder,
  opened per lock (strategy ``connect``) or taken from this process's idle ones
  (``reuse``);
- :class:`~.shared.SharedSource`: every lock of the process on at most
  ``pglock_shared_sessions`` sessions (strategy ``shared``).

The :data:`registry` is the one piece of per-process state: the sources of this
process, one per configuration, and the loss monitor. One fork hook keeps a
forked child off its parent's sessions.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator

from ..config import PglockConfig
from ..monitor import Monitor
from ..rollout import MapIdentity
from ..session import LockSession, open_bound
from .base import SHARED, Source
from .dedicated import DedicatedSource
from .shared import SharedSource


class Registry:
    """This process's sources, one per configuration, and its loss monitor."""

    def __init__(self) -> None:
        self.monitor = Monitor()
        #: The sources made so far (read without a lock: a dict lookup is atomic).
        #: Each configuration's source, by the configuration and its shard map: two
        #: maps' configurations of one shard compare equal, but their sessions record
        #: different maps (rollout.py), so they never share one.
        self.by_config: dict[tuple[PglockConfig, MapIdentity | None], Source] = {}
        self._mutex = threading.Lock()
        # Sockets being opened, not registered yet: a fork waits for them, each for as
        # long as its open can take (its deadline, time.monotonic()).
        self._opening: dict[int, float] = {}
        self._fork_barrier = threading.Condition()
        # A child's copies of its parent's sessions: kept alive, never finalized.
        self._inherited: list[LockSession] = []

    def source(self, config: PglockConfig) -> Source:
        """The source of ``config``'s sessions in this process (made on first use)."""
        key = (config, config.map_identity)
        found = self.by_config.get(key)
        if found is not None:
            return found
        with self._mutex:
            found = self.by_config.get(key)
            if found is None:
                kind = SharedSource if config.strategy == SHARED else DedicatedSource
                found = self.by_config[key] = kind(config, self)
            return found

    def sources(self) -> list[Source]:
        with self._mutex:
            return list(self.by_config.values())

    @contextlib.contextmanager
    def opening(self, config: PglockConfig) -> Iterator[None]:
        """Around opening a session until its source registered it: a fork meanwhile waits.

        A child forked while a socket exists that is not registered yet would keep
        a copy of it open, and with it the parent's locks after the parent died. The
        fork waits as long as this open can take (session.open_bound), and no longer.
        """
        token = object()
        with self._fork_barrier:
            self._opening[id(token)] = time.monotonic() + open_bound(config)
        try:
            yield
        finally:
            with self._fork_barrier:
                del self._opening[id(token)]
                if not self._opening:
                    self._fork_barrier.notify_all()

    def close(self) -> None:
        """Close every session of this process that holds nothing."""
        for source in self.sources():
            source.close()

    def idle_count(self) -> int:
        """Idle sessions this process keeps (strategy ``reuse``; for tests and benchmarks)."""
        sources = self.sources()
        return sum(s.idle_count() for s in sources if isinstance(s, DedicatedSource))

    def shared_count(self) -> int:
        """Shared sessions this process has open (for tests and benchmarks)."""
        sources = self.sources()
        return sum(s.session_count() for s in sources if isinstance(s, SharedSource))

    def _before_fork(self) -> None:
        barrier = self._fork_barrier
        barrier.acquire()
        while self._opening:
            left = max(self._opening.values()) - time.monotonic()
            if left <= 0:
                return  # an open outlived what it can take: it has failed by now
            barrier.wait(left)

    def _after_fork_in_parent(self) -> None:
        self._fork_barrier.release()

    def _after_fork_in_child(self) -> None:
        # The parent's threads are gone; a lock one of them held would never be released.
        self._mutex = threading.Lock()
        self._fork_barrier, self._opening = threading.Condition(), {}
        # The sources stay (a lock made before the fork keeps its own), emptied.
        for source in self.by_config.values():
            self._inherited += source.after_fork_in_child()
        self.monitor.after_fork_in_child()


#: This process's sessions and monitor (the only module-level state of the library's core).
registry = Registry()
os.register_at_fork(
    before=registry._before_fork,
    after_in_parent=registry._after_fork_in_parent,
    after_in_child=registry._after_fork_in_child,
)
