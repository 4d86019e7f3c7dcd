"""The doctor's capacity check: the server's lock table, the locks in it, the fleet's need."""

from __future__ import annotations

from collections.abc import Iterator

import psycopg
import pytest

from pglock_celery import try_lock
from pglock_celery.doctor import Finding, run_checks
from pglock_celery.sources import registry
from tests.support.cli import cli
from tests.support.services import EmbeddedPostgres

#: The small server's lock table: 10 x (20 + 0) = 200 entries.
SMALL_CAPACITY = 200


def capacity(findings: list[Finding]) -> Finding:
    (finding,) = [f for f in findings if f.check == "capacity"]
    return finding


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A server of the tests' own whose lock table is tiny, so that every count is exact."""
    server = EmbeddedPostgres(tmp_path_factory.mktemp("small-lock-table"))
    server.init("max_connections = 20", "max_locks_per_transaction = 10")
    server.start()
    yield server.dsn
    server.destroy()


@pytest.fixture
def foreign(small: str) -> Iterator[psycopg.Connection]:
    """A plain session (not pglock's) that the test makes hold advisory locks."""
    with psycopg.connect(small, autocommit=True) as conn:
        yield conn


def hold(conn: psycopg.Connection, count: int) -> None:
    conn.execute(
        "SELECT count(pg_advisory_lock(k)) FROM generate_series(1::int8, %s::int8) k", (count,)
    )


def test_capacity_is_max_locks_per_transaction_times_connections_on_the_real_server(
    pg_dsn: str,
) -> None:
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT current_setting('max_locks_per_transaction')::int"
            " * (current_setting('max_connections')::int"
            " + current_setting('max_prepared_transactions')::int)"
        ).fetchone()
    assert row is not None
    finding = capacity(run_checks(pg_dsn))
    assert finding.message.startswith(f"room for {row[0]:,} locks (max_locks_per_transaction")
    assert finding.level in ("ok", "warn")  # others' locks on a shared server may be many


def test_capacity_counts_the_advisory_locks_held_now_and_which_are_pglocks(
    small: str, foreign: psycopg.Connection
) -> None:
    hold(foreign, 30)
    with try_lock("capacity:a", dsn=small) as a, try_lock("capacity:b", dsn=small) as b:
        assert a.acquired and b.acquired
        finding = capacity(run_checks(small))
    registry.close()
    assert finding.level == "ok"
    # A pglock lock is taken twice on its session (count 2) but is one entry.
    assert "32 in use (32 advisory, 2 of them by pglock sessions)" in finding.message


def test_capacity_warns_over_80_percent_of_the_lock_table_with_the_fix(
    small: str, foreign: psycopg.Connection
) -> None:
    hold(foreign, 170)
    finding = capacity(run_checks(small))
    assert finding.level == "warn"
    assert finding.message.endswith("over 80% of the lock table")
    assert finding.fix.startswith("ALTER SYSTEM SET max_locks_per_transaction = 64 and restart")


def test_capacity_fails_when_the_fleets_locks_would_not_fit(
    small: str, foreign: psycopg.Connection
) -> None:
    hold(foreign, 50)
    assert capacity(run_checks(small, locks=100)).level == "ok"  # 150 of 200
    assert capacity(run_checks(small, locks=120)).level == "warn"  # 170 of 200
    done = cli("doctor", "--locks", "151", dsn=small)
    print("\n" + done.stdout)
    assert done.returncode == 1
    assert "with the fleet's 151 that makes 201: past the lock table's size" in done.stdout
    assert "fix: ALTER SYSTEM SET max_locks_per_transaction = 64" in done.stdout


def test_the_fleets_locks_held_now_are_not_counted_twice(small: str) -> None:
    """Run during the fleet's peak, `--locks N` counts its running locks once, in N."""
    with try_lock("capacity:c", dsn=small) as c, try_lock("capacity:d", dsn=small) as d:
        assert c.acquired and d.acquired
        finding = capacity(run_checks(small, locks=10))
    registry.close()
    assert "2 of them by pglock sessions); with the fleet's 10 that makes 10" in finding.message


def test_capacity_with_a_large_fleet_names_a_setting_that_fits_it(small: str) -> None:
    finding = capacity(run_checks(small, locks=10_000))
    assert finding.level == "fail"
    # 10,000 / 0.8 / 20 slots = 625 per slot, rounded up to a multiple of 64.
    assert finding.fix.startswith("ALTER SYSTEM SET max_locks_per_transaction = 640 ")


def test_fast_path_locks_take_no_room_in_the_lock_table(small: str) -> None:
    """A transaction's weak table locks live in its backend's fast path, not the shared table."""
    with psycopg.connect(small) as reader:
        reader.execute("SELECT count(*) FROM pg_class").fetchone()  # transaction left open
        finding = capacity(run_checks(small))
        reader.rollback()
    assert "room for 200 locks" in finding.message
    assert ", 0 in use (0 advisory" in finding.message
