"""The leader fence against a real Patroni cluster whose REST API is HTTPS with a private
CA and ``restapi.verify_client: required``, run with ``failsafe_mode: true``.

TLS: the pglock settings (pglock_patroni_cafile, pglock_patroni_certfile,
pglock_patroni_keyfile) are all the fence and the doctor need; nothing process-wide
(SSL_CERT_FILE) is set or changed. Failsafe: with etcd killed, Patroni keeps its primary
running, and the fence refuses every lock with a reason naming the DCS outage and failsafe
mode (patroni.py's docstring says why no window can be proven there); locks come back
with etcd. One cluster for the module; the outage runs last.
"""

from __future__ import annotations

import os
import ssl
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from pglock_celery import LockLost, LockUnavailable
from pglock_celery.doctor import Finding, run_checks
from pglock_celery.task import configuration_problems
from tests.failover.conftest import require_tools
from tests.support.locks import eager_app, lock
from tests.support.patroni import Member, PatroniCluster
from tests.support.services import wait_until

pytestmark = pytest.mark.failover

FENCE_CHECKS = ("patroni urls", "patroni members", "patroni leader", "patroni window")


@pytest.fixture(scope="module")
def https() -> Iterator[PatroniCluster]:
    """HTTPS REST APIs (verify_client: required), failsafe_mode on."""
    require_tools()
    cluster = PatroniCluster(tls=True, dcs={"failsafe_mode": True})
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(autouse=True)
def no_process_wide_tls(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("SSL_CERT_FILE", "SSL_CERT_DIR"):
        monkeypatch.delenv(name, raising=False)


def tls(cluster: PatroniCluster, *names: str) -> dict[str, str]:
    """The pglock TLS settings ``names`` (all three when none given), as lock() takes them."""
    names = names or ("patroni_cafile", "patroni_certfile", "patroni_keyfile")
    return {name: str(cluster.tls_files[name]) for name in names}


def urls(cluster: PatroniCluster) -> tuple[str, ...]:
    return tuple(cluster.urls.split(","))


def leader_of(cluster: PatroniCluster) -> Member:
    return wait_until(cluster.leader, 60, "one member to hold the leader key")


def test_a_fenced_lock_over_https_with_verify_client_needs_only_the_pglock_tls_settings(
    https: PatroniCluster,
) -> None:
    leader = leader_of(https)
    app = eager_app(https.dsn(), "https-start", patroni_url=https.urls, **tls(https))
    assert configuration_problems(app) == []  # the worker-start check reads the cluster
    held = lock(https.dsn(), f"https:{uuid.uuid4().hex[:8]}", patroni_url=urls(https), **tls(https))
    assert held.acquire(), held.loss
    try:
        assert held.connection.info.port == leader.pg_port
    finally:
        held.release()
    # Nothing process-wide changed: the default context still trusts no private CA.
    assert "SSL_CERT_FILE" not in os.environ
    with pytest.raises(urllib.error.URLError) as untrusted:
        urllib.request.urlopen(leader.api_url + "/patroni", timeout=2)
    assert isinstance(untrusted.value.reason, ssl.SSLCertVerificationError)


@pytest.mark.parametrize(
    ("given", "named"),
    [
        ((), "pglock_patroni_cafile"),
        (("patroni_cafile",), "pglock_patroni_certfile"),
    ],
    ids=["no-ca", "no-client-certificate"],
)
def test_a_lock_is_refused_at_once_naming_the_tls_setting_that_is_missing(
    https: PatroniCluster, given: tuple[str, ...], named: str
) -> None:
    leader_of(https)
    settings: dict[str, Any] = tls(https, *given) if given else {}
    held = lock(https.dsn(), f"https:{uuid.uuid4().hex[:8]}", patroni_url=urls(https), **settings)
    started = time.monotonic()
    with pytest.raises(LockUnavailable) as refused:
        held.acquire()
    message = str(refused.value)
    assert "TLS" in message and named in message, message
    assert time.monotonic() - started < 10


def findings(
    monkeypatch: pytest.MonkeyPatch, cluster: PatroniCluster, *names: str
) -> dict[str, Finding]:
    monkeypatch.setenv("PGLOCK_PATRONI_URL", cluster.urls)
    for name, path in cluster.tls_settings().items():
        if name.removeprefix("PGLOCK_").lower() in names:
            monkeypatch.setenv(name, path)
        else:
            monkeypatch.delenv(name, raising=False)
    found = run_checks(cluster.dsn())
    for finding in found:
        print(finding.line())
    return {f.check: f for f in found if f.check in FENCE_CHECKS}


def test_the_doctor_checks_an_https_cluster_with_the_pglock_tls_settings(
    https: PatroniCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    leader_of(https)
    every = findings(monkeypatch, https, "patroni_cafile", "patroni_certfile", "patroni_keyfile")
    assert {check: f.level for check, f in every.items()} == dict.fromkeys(FENCE_CHECKS, "ok")


@pytest.mark.parametrize(
    ("given", "named"),
    [((), "pglock_patroni_cafile"), (("patroni_cafile",), "pglock_patroni_certfile")],
    ids=["no-ca", "no-client-certificate"],
)
def test_the_doctor_says_a_tls_failure_is_a_certificate_problem_not_a_silent_member(
    https: PatroniCluster, monkeypatch: pytest.MonkeyPatch, given: tuple[str, ...], named: str
) -> None:
    leader_of(https)
    found = findings(monkeypatch, https, *given)["patroni urls"]
    assert found.level == "fail"
    assert "certificate problem (the member is up)" in found.message, found.message
    assert named in found.message, found.message
    assert "no answer" not in found.message and "start that member" not in found.fix, found


def failsafe_active(member: Member) -> bool:
    status, body = member.status("/patroni", timeout=1.0)
    return status == 200 and bool(body and body.get("failsafe_mode_is_active"))


def test_during_a_dcs_outage_in_failsafe_mode_no_lock_is_confirmed_and_the_reason_says_so(
    https: PatroniCluster,
) -> None:
    """etcd killed: a held lock is lost within the window, every try meanwhile is refused
    naming the DCS outage and failsafe mode (not 'GET /config could not be read'), and
    locks are granted again once etcd is back."""
    leader = leader_of(https)
    members = urls(https)
    held = lock(leader.dsn, f"failsafe:{uuid.uuid4().hex[:8]}", patroni_url=members,
                check_interval=0.5, **tls(https))  # fmt: skip
    assert held.acquire(), held.loss
    https.kill_etcd()
    killed = time.monotonic()
    try:
        wait_until(lambda: held.loss is not None, 20, "the held lock to be lost")
        lost_after = time.monotonic() - killed
        assert "DCS" in str(held.loss), held.loss
        wait_until(lambda: failsafe_active(leader), 30, "Patroni to lead on in failsafe mode")
        refusals = []
        until = time.monotonic() + 8  # Patroni leads on meanwhile; the fence stays shut
        while time.monotonic() < until:
            attempt = lock(leader.dsn, f"failsafe:{uuid.uuid4().hex[:8]}", patroni_url=members,
                           **tls(https))  # fmt: skip
            with pytest.raises(LockUnavailable) as refused:
                attempt.acquire()
            refusals.append(str(refused.value))
        print(f"lost after {lost_after:.1f} s; {len(refusals)} refusals, e.g. {refusals[-1]}")
        assert failsafe_active(leader)
        for message in refusals:
            assert "cannot reach its DCS" in message and "failsafe mode" in message, message
    finally:
        https.start_etcd()
    with pytest.raises(LockLost):
        held.release()

    def granted() -> bool:
        again = lock(https.dsn(), f"failsafe:{uuid.uuid4().hex[:8]}", patroni_url=members,
                     **tls(https))  # fmt: skip
        try:
            if not again.acquire():
                return False
        except LockUnavailable:
            return False
        again.release()
        return True

    wait_until(granted, 60, "a lock granted once etcd is back", interval=0.5)
