"""The leader fence against a real Patroni 4.1.5 + etcd cluster (tests/support/patroni.py)."""

from __future__ import annotations

import os
import signal
import time

import psycopg

from pglock_celery.patroni import LeaderFence, ServerIdentity, server_identity
from tests.support.patroni import Member, PatroniCluster
from tests.support.services import wait_until


def identity(member: Member) -> ServerIdentity:
    with psycopg.connect(member.dsn, connect_timeout=5) as conn:
        return server_identity(conn)


def leader_of(cluster: PatroniCluster) -> Member:
    return wait_until(cluster.leader, 60, "one member to hold the leader key")


def test_the_leader_is_confirmed_for_the_window_its_configuration_gives(
    patroni: PatroniCluster,
) -> None:
    fence = LeaderFence.from_setting(patroni.urls)
    leader = leader_of(patroni)
    sent = time.monotonic()
    verdict = fence.confirm(identity(leader))
    assert verdict.leader, verdict.reason
    assert verdict.member == leader.name
    timing = fence.timing()
    assert timing is not None
    assert (timing.ttl, timing.loop_wait, timing.retry_timeout) == (20, 2, 4)
    window = 20 - 2 - max(4, 2 + 2 + 1) - fence.margin
    assert sent + window <= verdict.until <= time.monotonic() + window


def test_a_replica_is_refused_as_not_the_leader(patroni: PatroniCluster) -> None:
    fence = LeaderFence.from_setting(patroni.urls)
    leader = leader_of(patroni)
    for replica in (m for m in patroni.members if m is not leader):
        verdict = fence.confirm(identity(replica))
        assert not verdict.leader
        assert verdict.reason.startswith("not the leader"), verdict.reason
        assert verdict.member == replica.name


def test_a_paused_patroni_is_cannot_tell_within_the_timeout(patroni: PatroniCluster) -> None:
    fence = LeaderFence.from_setting(patroni.urls)
    leader = leader_of(patroni)
    server = identity(leader)
    first = fence.confirm(server)
    assert first.leader, first.reason
    pid = leader.patroni_pid
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)
    try:
        began = time.monotonic()
        verdict = fence.confirm(server, fresh_for=first.until - began + 1)  # must ask again
        took = time.monotonic() - began
    finally:
        os.kill(pid, signal.SIGCONT)
    assert not verdict.leader
    assert "cannot tell" in verdict.reason and "timed out" in verdict.reason, verdict.reason
    assert took < 2 * fence.timeout + 0.5
    wait_until(lambda: fence.confirm(server).leader, 30, "the resumed leader to be confirmed")


def test_a_longer_ttl_in_patronis_configuration_widens_the_window(
    patroni: PatroniCluster,
) -> None:
    fence = LeaderFence(patroni.urls.split(","), config_max_age=0.0)
    server = identity(leader_of(patroni))
    patroni.patch_config({"ttl": 30})
    try:

        def widened() -> bool:
            sent = time.monotonic()
            verdict = fence.confirm(server, fresh_for=30)
            timing = fence.timing()
            return (
                verdict.leader
                and timing is not None
                and timing.ttl == 30
                and verdict.until >= sent + 30 - 2 - 5 - fence.margin
            )

        wait_until(widened, 30, "a confirmation for the window of ttl 30")
    finally:
        patroni.patch_config({"ttl": 20})
    wait_until(lambda: patroni.config()["ttl"] == 20, 30, "ttl back to 20")


def test_after_a_switchover_the_old_leader_is_refused_and_the_new_one_confirmed(
    patroni: PatroniCluster,
) -> None:
    fence = LeaderFence.from_setting(patroni.urls)
    old = leader_of(patroni)
    old_server = identity(old)
    assert fence.confirm(old_server).leader
    _, new = patroni.switchover()
    new_server = wait_until(
        lambda: patroni.leader() is new and identity(new), 60, "the candidate to lead"
    )
    verdict = wait_until(
        lambda: (v := fence.confirm(new_server)).leader and v, 30, "the new leader confirmed"
    )
    assert verdict.member == new.name
    refused = fence.confirm(old_server, fresh_for=60)
    assert not refused.leader, refused.reason
    if not refused.reason.startswith("not the leader"):
        # Patroni restarted the old primary as a replica: a session of the old
        # postmaster matches no member any more.
        assert "cannot tell" in refused.reason, refused.reason
    patroni.wait_healthy(60)
    assert not fence.confirm(identity(old)).leader
