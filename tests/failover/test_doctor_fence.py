"""The doctor checks the leader fence against a real Patroni 4.1.5 + etcd cluster.

With ``pglock_patroni_url`` set, each problem of the fence (a silent URL, a member left
out, a leader outside the DSN, a window too short for any check interval) is a ``[FAIL]``
finding with a fix that pastes; a healthy cluster's fence findings are ``[ok]``.
"""

from __future__ import annotations

import pytest

from pglock_celery.doctor import Finding, run_checks
from tests.failover.test_leader_fence import leader_of, timing
from tests.support.cli import cli
from tests.support.patroni import PatroniCluster
from tests.support.services import free_port

FENCE_CHECKS = ("patroni urls", "patroni members", "patroni leader", "patroni window")


def fence_findings(monkeypatch: pytest.MonkeyPatch, dsn: str, urls: str) -> dict[str, Finding]:
    monkeypatch.setenv("PGLOCK_PATRONI_URL", urls)
    findings = run_checks(dsn)
    for found in findings:
        print(found.line())
    return {f.check: f for f in findings if f.check in FENCE_CHECKS}


def test_a_healthy_clusters_fence_findings_are_ok_and_exit_0(
    patroni: PatroniCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    leader_of(patroni)
    monkeypatch.setenv("PGLOCK_PATRONI_URL", patroni.urls)
    done = cli("doctor", dsn=patroni.dsn())
    print("\n" + done.stdout + done.stderr)
    for check in FENCE_CHECKS:
        assert f"[ok]   {check}: " in done.stdout
    assert "window 11 s at ttl 20/loop_wait 2/retry_timeout 4: locks checked every 2 s" in (
        done.stdout
    )
    assert "[FAIL]" not in done.stdout
    assert done.returncode == 0


def test_a_url_list_missing_a_member_fails_naming_it(
    patroni: PatroniCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    leader_of(patroni)
    left_out = patroni.members[-1]
    urls = ",".join(m.api_url for m in patroni.members[:-1])
    found = fence_findings(monkeypatch, patroni.dsn(), urls)["patroni members"]
    assert found.level == "fail"
    assert f"{left_out.name} (127.0.0.1:{left_out.api_port})" in found.message
    assert found.fix == f'app.conf.pglock_patroni_url = "{patroni.urls}"'


def test_an_unreachable_url_fails_and_exits_1(
    patroni: PatroniCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    leader_of(patroni)
    closed = free_port()
    monkeypatch.setenv("PGLOCK_PATRONI_URL", f"{patroni.urls},http://127.0.0.1:{closed}")
    done = cli("doctor", dsn=patroni.dsn())
    print("\n" + done.stdout + done.stderr)
    assert (
        f"[FAIL] patroni urls: no answer to GET /patroni within 1 s from 127.0.0.1:{closed}"
        " (connection refused)" in done.stdout
    )
    assert "1 problem(s) found" in done.stdout
    assert done.returncode == 1


def test_a_url_naming_only_a_replica_fails_for_the_members_left_out(
    patroni: PatroniCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    leader = leader_of(patroni)
    replica = next(m for m in patroni.members if m is not leader)
    found = fence_findings(monkeypatch, patroni.dsn(), replica.api_url)["patroni members"]
    assert found.level == "fail"
    assert "leaves out 2 of the cluster's 3 members" in found.message
    for member in (m for m in patroni.members if m is not replica):
        assert f"{member.name} (127.0.0.1:{member.api_port})" in found.message
    assert f"{replica.name} (" not in found.message


def test_a_dsn_whose_hosts_leave_out_the_leader_fails(
    patroni: PatroniCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    leader = leader_of(patroni)
    replica = next(m for m in patroni.members if m is not leader)
    found = fence_findings(monkeypatch, replica.dsn, patroni.urls)["patroni leader"]
    assert found.level == "fail"
    assert f"the leader {leader.name} runs on 127.0.0.1:{leader.pg_port}" in found.message
    assert f"127.0.0.1:{replica.pg_port}" in found.message
    ports = ",".join(str(m.pg_port) for m in patroni.members)
    assert f"port={ports} target_session_attrs=read-write" in found.fix


def test_a_window_too_short_for_any_check_interval_fails_naming_the_least_ttl(
    patroni: PatroniCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    leader_of(patroni)
    with timing(patroni, ttl=26, loop_wait=10, retry_timeout=5):
        found = fence_findings(monkeypatch, patroni.dsn(), patroni.urls)["patroni window"]
    assert found.level == "fail"
    # W = 26 - 10 - max(5, 13) - 2 = 1; 0.5 s needs 4.625: ttl 30 (ceil of 29.625).
    assert "window 1 s at ttl 26/loop_wait 10/retry_timeout 5" in found.message
    assert "the least ttl that fits is 30" in found.message
    assert found.fix == "patronictl edit-config -s ttl=30"
