"""The fence and the doctor read Patroni as Patroni reads itself, against the real Postgres.

A Patroni REST stand-in of the test's own (tests/support/patroni_standin.py) reports the
local Postgres as its leader, with what a real cluster cannot be made to show at will: a
dynamic configuration Patroni 4.1.5 would reject or change, an answer trickled one byte
at a time, host names spelled otherwise than the DSN spells them. The timings are
trusted as Patroni runs with them (never longer than their face value), a trickle ends
within the request timeout, and the doctor knows a server by its postmaster, as the
fence does, not by how a host is written.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from pglock_celery import try_lock
from pglock_celery.doctor import Finding, run_checks
from pglock_celery.exceptions import LockUnavailable
from pglock_celery.leader import ServerIdentity, server_identity
from pglock_celery.patroni import LeaderFence
from tests.support.patroni_standin import StandIn, cluster, postmaster_start

FENCE_CHECKS = ("patroni urls", "patroni members", "patroni leader", "patroni window")


@pytest.fixture
def server(pg_dsn: str) -> ServerIdentity:
    """The local Postgres, as a lock session identifies it."""
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        return server_identity(conn)


@pytest.fixture
def leader(pg_dsn: str) -> Iterator[StandIn]:
    member = StandIn("m0", postmaster_start(pg_dsn), pg_port=_port(pg_dsn))
    yield member
    member.close()


def _port(dsn: str) -> int:
    return int(conninfo_to_dict(dsn).get("port") or 5432)


def trusted_for(fence: LeaderFence, server: ServerIdentity) -> tuple[float, str]:
    """How long a confirmation asked now is trusted (0 when refused), and why not."""
    sent = time.monotonic()
    verdict = fence.confirm(server)
    return (verdict.until - sent if verdict.leader else 0.0), verdict.reason


def fence_findings(monkeypatch: pytest.MonkeyPatch, dsn: str, urls: str) -> dict[str, Finding]:
    monkeypatch.setenv("PGLOCK_PATRONI_URL", urls)
    findings = run_checks(dsn)
    for found in findings:
        print(found.line())
    return {f.check: f for f in findings if f.check in FENCE_CHECKS}


# -- Patroni's timings, as Patroni reads them -----------------------------------------


def test_a_ttl_patroni_cannot_read_as_an_integer_is_trusted_for_nothing_and_fails_doctor(
    pg_dsn: str, server: ServerIdentity, leader: StandIn, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Patroni's Config._validate_and_adjust_timeouts takes int("1e2"), which raises, and
    # set_dynamic_configuration then keeps its previous configuration: none the fence sees.
    leader.config = {"ttl": "1e2", "loop_wait": 2, "retry_timeout": 5}
    window, reason = trusted_for(LeaderFence([leader.url()]), server)
    print(f"trusted for {window:.2f} s: {reason}")
    assert window == 0.0
    assert "ttl" in reason and "rejects" in reason
    monkeypatch.setenv("PGLOCK_PATRONI_URL", leader.url())
    with pytest.raises(LockUnavailable, match="rejects"), try_lock("rules:1e2", dsn=pg_dsn):
        pass
    found = fence_findings(monkeypatch, pg_dsn, leader.url())["patroni window"]
    assert found.level == "fail", found.line()
    assert "ttl '1e2'" in found.message and "rejects" in found.message
    assert "patronictl edit-config -s ttl=" in found.fix


def test_timings_below_patronis_minimums_are_trusted_as_patroni_raises_them_and_warn(
    pg_dsn: str, server: ServerIdentity, leader: StandIn, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Patroni raises loop_wait to 1 and retry_timeout to 3: W = 20 - 1 - max(3, 4) - 2.
    leader.config = {"ttl": 20, "loop_wait": 0.25, "retry_timeout": 2}
    window, reason = trusted_for(LeaderFence([leader.url()]), server)
    print(f"trusted for {window:.2f} s {reason}")
    assert abs(window - 13.0) < 0.1
    found = fence_findings(monkeypatch, pg_dsn, leader.url())["patroni window"]
    print(found.fix)
    assert found.level == "warn", found.line()
    assert "window 13 s at ttl 20/loop_wait 1/retry_timeout 3" in found.message
    assert "loop_wait 0.25 to 1" in found.message and "retry_timeout 2 to 3" in found.message
    assert found.fix == "patronictl edit-config -s loop_wait=1 -s retry_timeout=3"


@pytest.mark.parametrize(
    ("config", "window"),
    [
        # Patroni lowers loop_wait to ttl - 2 * retry_timeout: never trusted longer for it.
        ({"ttl": 20, "loop_wait": 5, "retry_timeout": 9}, 20 - 5 - 9 - 2),
        # A ttl under 20 is raised to 20: its face value 15 still bounds the window.
        ({"ttl": 15, "loop_wait": 1, "retry_timeout": 3}, 15 - 1 - 4 - 2),
    ],
    ids=["loop-wait-lowered", "ttl-raised"],
)
def test_a_timing_patroni_changes_is_never_trusted_longer_than_its_face_value(
    server: ServerIdentity, leader: StandIn, config: dict[str, Any], window: float
) -> None:
    leader.config = config
    trusted, reason = trusted_for(LeaderFence([leader.url()]), server)
    print(f"trusted for {trusted:.2f} s {reason}")
    assert abs(trusted - window) < 0.1


# -- every request has a total deadline ------------------------------------------------


def test_a_member_trickling_its_answer_ends_a_fenced_try_within_the_request_timeout(
    pg_dsn: str, leader: StandIn, run_id: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    leader.trickle = 0.2  # a byte every 0.2 s: each read well within the 1 s timeout
    monkeypatch.setenv("PGLOCK_PATRONI_URL", leader.url())
    fence = LeaderFence([leader.url()])
    began = time.monotonic()
    with pytest.raises(LockUnavailable) as refused, try_lock(f"{run_id}:free", dsn=pg_dsn):
        pass
    took = time.monotonic() - began
    print(f"the trickled try took {took:.2f} s, asking {leader.requests}")
    assert took < fence.longest_ask + 0.5
    assert "timed out" in str(refused.value)
    began = time.monotonic()
    answer = fence.status(leader.url(), "/patroni")
    one = time.monotonic() - began
    print(f"one trickled request took {one:.2f} s: {answer.error}")
    assert answer.status == 0 and answer.timed_out
    assert one < fence.timeout + 0.25


# -- the doctor knows servers by what they are ----------------------------------------


@pytest.mark.parametrize(
    ("dsn_host", "reported"), [("localhost", "127.0.0.1"), ("127.0.0.1", "localhost")]
)
def test_the_doctor_knows_the_leader_and_members_by_identity_however_hosts_are_spelled(
    pg_dsn: str, monkeypatch: pytest.MonkeyPatch, dsn_host: str, reported: str
) -> None:
    dsn = make_conninfo(pg_dsn, host=dsn_host)
    port = _port(pg_dsn)
    with cluster([postmaster_start(pg_dsn)], pg_host=reported, api_host=reported) as members:
        (member,) = members
        member.pg_port = port
        found = fence_findings(monkeypatch, dsn, member.url(dsn_host))
    for check in FENCE_CHECKS:
        assert found[check].level != "fail", found[check].line()
    assert found["patroni leader"].level == "ok"
    assert found["patroni members"].level == "ok"


def test_the_doctors_fix_for_a_member_left_out_lists_each_member_once(
    pg_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    replica_start = postmaster_start(pg_dsn).replace(year=2001)
    with cluster([postmaster_start(pg_dsn), replica_start]) as members:
        members[0].pg_port = _port(pg_dsn)
        found = fence_findings(monkeypatch, pg_dsn, members[0].url("localhost"))
        wanted = f"{members[0].url('localhost')},{members[1].url()}"
    left_out = found["patroni members"]
    assert left_out.level == "fail"
    assert "leaves out 1 of the cluster's 2 members: m1 (127.0.0.1:" in left_out.message
    assert left_out.fix == f'app.conf.pglock_patroni_url = "{wanted}"'
