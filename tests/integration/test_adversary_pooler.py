"""Adversarial: the pooler check of connection._verify_session against a real PgBouncer."""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterator

import pytest

from pglock_celery import LockLost, LockUnavailable
from pglock_celery.sources import registry
from tests.adversary_helpers import make_lock, taken_elsewhere
from tests.adversary_helpers.bouncer import PGBOUNCER, pgbouncer
from tests.conftest import IN_CI


@pytest.fixture(autouse=True)
def pgbouncer_installed() -> None:
    """Without pgbouncer these tests cannot run: a failure in CI, a skip elsewhere."""
    if not shutil.which(PGBOUNCER):
        if IN_CI:
            pytest.fail("pgbouncer is not installed (make test installs it as root)")
        pytest.skip("no pgbouncer")


@pytest.fixture(autouse=True)
def empty_cache() -> None:
    registry.close()


@pytest.fixture
def transaction_bouncer(pg_dsn: str) -> Iterator[str]:
    with pgbouncer(pg_dsn, "transaction") as dsn:
        yield dsn


@pytest.fixture
def session_bouncer(pg_dsn: str) -> Iterator[str]:
    with pgbouncer(pg_dsn, "session", pool_size=4) as dsn:
        yield dsn


def test_two_holders_through_a_transaction_pooler_never_both_hold(
    transaction_bouncer: str, pg_dsn: str, run_id: str
) -> None:
    """Told "session" but put behind a transaction-mode pooler: never two holders of one name."""
    name = f"adv:bouncer:{run_id}"
    first = make_lock(transaction_bouncer, name, pooler="session")
    second = make_lock(transaction_bouncer, name, pooler="session")
    try:
        assert first.acquire()
        try:
            both = second.acquire()
        except LockUnavailable:
            both = False  # refusing is fine: failing closed
        assert not both, "two lock objects hold the same name at once through the pooler"
    finally:
        for lock in (second, first):
            with contextlib.suppress(LockLost, LockUnavailable):
                lock.release()
        registry.close()


# --- probes that pass: kept as regression tests ---------------------------------------


def test_a_transaction_pooler_is_refused_by_default(transaction_bouncer: str, run_id: str) -> None:
    """Probe: with the default pglock_pooler = "none", a PgBouncer is refused (fail closed)."""
    lock = make_lock(transaction_bouncer, f"adv:bouncer2:{run_id}")
    with pytest.raises(LockUnavailable, match="pooler"):
        lock.acquire()
    assert not lock.acquired


def test_a_session_pooler_excludes_and_is_never_reused(
    session_bouncer: str, pg_dsn: str, run_id: str
) -> None:
    """Probe: behind a session-mode pooler, one holder at a time, and no session is cached."""
    name = f"adv:bouncer3:{run_id}"
    first = make_lock(session_bouncer, name, pooler="session")
    second = make_lock(session_bouncer, name, pooler="session")
    assert first.acquire()
    try:
        assert not second.acquire()
        second.release()
        assert not taken_elsewhere(pg_dsn, first.key)
    finally:
        first.release()
    assert registry.idle_count() == 0
