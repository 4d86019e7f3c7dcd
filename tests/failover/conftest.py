"""A Patroni cluster per test module or test: started and stopped by the tests themselves.

Where the machine cannot run one (no etcd, no Patroni venv and no way to build it), the
tests skip, except in CI, where they fail.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.support.ci import missing
from tests.support.patroni import ClusterUnavailable, PatroniCluster, ensure_tools


def require_tools() -> None:
    """Skip (fail in CI) where this machine cannot run a Patroni cluster."""
    try:
        ensure_tools()
    except ClusterUnavailable as exc:
        missing(str(exc))


@pytest.fixture(scope="module")
def patroni() -> Iterator[PatroniCluster]:
    """A healthy 3-member cluster shared by a module's tests, stopped at its end."""
    require_tools()
    cluster = PatroniCluster()
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def new_patroni() -> Iterator[Callable[..., PatroniCluster]]:
    """Start a cluster of the test's own on demand; every one is stopped at the end."""
    require_tools()
    started: list[PatroniCluster] = []

    def start(**options: Any) -> PatroniCluster:
        """A cluster of PatroniCluster(**options), started."""
        cluster = PatroniCluster(**options)
        started.append(cluster)
        cluster.start()
        return cluster

    try:
        yield start
    finally:
        for cluster in started:
            cluster.stop()
