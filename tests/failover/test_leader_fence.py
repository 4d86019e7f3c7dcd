"""The leader fence against a real Patroni 4.1.5 + etcd cluster (tests/support/patroni.py)."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
import uuid
from collections.abc import Iterator

import psutil
import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from pglock_celery import LockLost, LockUnavailable, TenantLockedTask, lock_key
from pglock_celery.leader import ServerIdentity, server_identity
from pglock_celery.loss import LossKind
from pglock_celery.patroni import LeaderFence
from pglock_celery.session import STATEMENT_DEADLINE
from pglock_celery.task import configuration_problems
from tests.support.locks import DEDICATED, STRATEGIES, eager_app, free_elsewhere, lock
from tests.support.patroni import Member, PatroniCluster
from tests.support.services import EmbeddedPostgres, free_port, wait_until


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


@pytest.mark.parametrize("strategy", DEDICATED)
def test_a_body_waiting_in_a_statement_is_stopped_once_its_leader_cannot_be_confirmed(
    patroni: PatroniCluster, strategy: str
) -> None:
    """The fence asks no statement of the session, and neither does telling the holder.

    The body waits in a statement (on a row lock another session keeps; on a deposed
    primary it would be a statement the frozen server never answers) when Patroni stops
    answering: the body's statement fails with LockLost within the fence's detection,
    not when the statement ends. (A shared session runs no statement of a holder's;
    the next test shows its cut on the fence's verdict.)
    """
    leader = leader_of(patroni)
    fence = LeaderFence.from_setting(patroni.urls)
    server = identity(leader)
    wait_until(lambda: fence.confirm(server).leader, 30, "the leader to be confirmed")
    table = f"fence_rows_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(leader.dsn, autocommit=True) as admin:
        admin.execute(f"CREATE TABLE {table} (id int PRIMARY KEY)")
        admin.execute(f"INSERT INTO {table} VALUES (1)")
    blocker = psycopg.connect(leader.dsn)
    blocker.execute(f"SELECT * FROM {table} WHERE id = 1 FOR UPDATE")
    held = lock(
        leader.dsn,
        f"fence:{strategy}:{table}",
        strategy=strategy,
        patroni_url=tuple(patroni.urls.split(",")),
        check_interval=0.5,
    )
    assert held.acquire()
    backend = held.backend_pid
    outcome: list[object] = []

    def body() -> None:
        try:
            with held.transaction() as conn:
                conn.execute(f"SELECT * FROM {table} WHERE id = 1 FOR UPDATE")
            outcome.append("committed")
        except BaseException as exc:
            outcome.append(exc)

    waiting = threading.Thread(target=body)
    waiting.start()
    pid = leader.patroni_pid
    assert pid is not None
    try:
        with psycopg.connect(leader.dsn, autocommit=True) as look:
            wait_until(
                lambda: (
                    look.execute(
                        "SELECT wait_event_type = 'Lock' FROM pg_stat_activity WHERE pid = %s",
                        (backend,),
                    ).fetchone()
                    == (True,)
                ),
                10,
                "the body to wait on the row",
            )
        os.kill(pid, signal.SIGSTOP)
        waiting.join(15)  # the fence's detection is a few seconds (check + 2 timeouts)
        stopped = not waiting.is_alive()
    finally:
        os.kill(pid, signal.SIGCONT)
        blocker.close()
    waiting.join(10)
    with pytest.raises(LockLost):
        held.release()
    with psycopg.connect(leader.dsn, autocommit=True) as admin:
        admin.execute(f"DROP TABLE {table}")
    wait_until(lambda: fence.confirm(server).leader, 30, "the resumed leader to be confirmed")
    assert stopped, "the body stayed in its statement after the fence refused its server"
    assert len(outcome) == 1 and isinstance(outcome[0], LockLost), outcome


def test_every_lock_on_a_shared_session_is_lost_and_its_session_cut_when_the_leader_is_unknown(
    patroni: PatroniCluster,
) -> None:
    """The fence's verdict is the server's: every lock on a shared session is found lost
    (not the leader, or cannot tell) and the session ends on the server."""
    leader = leader_of(patroni)
    fence = LeaderFence.from_setting(patroni.urls)
    server = identity(leader)
    wait_until(lambda: fence.confirm(server).leader, 30, "the leader to be confirmed")
    run = uuid.uuid4().hex[:8]
    held = [
        lock(
            leader.dsn,
            f"fence-shared:{run}:{n}",
            strategy="shared",
            shared_sessions=1,
            patroni_url=tuple(patroni.urls.split(",")),
            check_interval=0.5,
        )
        for n in range(3)
    ]
    for one in held:
        assert one.acquire()
    backend = held[0].backend_pid
    pid = leader.patroni_pid
    assert pid is not None
    try:
        os.kill(pid, signal.SIGSTOP)
        wait_until(lambda: all(one.loss for one in held), 15, "every shared lock to be lost")
    finally:
        os.kill(pid, signal.SIGCONT)
    assert {one.loss.kind for one in held if one.loss} <= {
        LossKind.NOT_LEADER,
        LossKind.CANNOT_TELL,
    }
    with psycopg.connect(leader.dsn, autocommit=True) as look:
        wait_until(
            lambda: (
                look.execute("SELECT 1 FROM pg_stat_activity WHERE pid = %s", (backend,)).fetchone()
                is None
            ),
            10,
            "the cut shared session to end on the server",
        )
    for one in held:
        with pytest.raises(LockLost):
            one.release()
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


#: The failover tests' own timing (tests/support/patroni.py), put back after a test changes it.
TEST_TIMING = {"ttl": 20, "loop_wait": 2, "retry_timeout": 4}


@contextlib.contextmanager
def timing(cluster: PatroniCluster, **values: int) -> Iterator[None]:
    """The cluster's dynamic configuration set to ``values`` for the block, then put back."""
    keys = tuple(values)

    def now_is(wanted: dict[str, int]) -> bool:
        config = cluster.config()
        return all(config.get(key) == wanted[key] for key in keys)

    cluster.patch_config(values)
    try:
        wait_until(lambda: now_is(values), 30, f"the cluster's configuration to be {values}")
        yield
    finally:
        back = {key: TEST_TIMING[key] for key in keys}
        cluster.patch_config(back)
        wait_until(lambda: now_is(back), 30, "the cluster's configuration back")


def test_a_lock_is_kept_at_patronis_default_timings_with_the_default_settings(
    patroni: PatroniCluster,
) -> None:
    """ttl 30, loop_wait 10, retry_timeout 10 trust a confirmation for 5 s; the default
    check interval (2 s) needs 6.5 s, so under the fence it is lowered to fit (0.8 s),
    and the lock is granted and kept, every check confirmed."""
    leader_of(patroni)
    with timing(patroni, ttl=30, loop_wait=10, retry_timeout=10):
        held = lock(patroni.dsn(), f"defaults:{uuid.uuid4().hex[:8]}", patroni_url=patroni.urls)
        assert held.config.check_interval == 2.0  # the default, untouched
        assert held.acquire(), held.loss
        try:
            hold = held._hold
            assert hold is not None
            # What the monitor schedules the hold's checks by.
            assert hold.source.check_interval(hold) == pytest.approx(0.8)
            kept_until = time.monotonic() + 4 * 1.25 * 2.0  # four default intervals
            while time.monotonic() < kept_until:
                assert held.loss is None, held.loss
                time.sleep(0.1)  # time has to pass: the checks run meanwhile
            assert held.held()
        finally:
            held.release()


def test_a_worker_refuses_to_start_when_no_check_interval_fits_the_clusters_window(
    patroni: PatroniCluster,
) -> None:
    """ttl 26 with loop_wait 10 leaves a 1 s window: no lock can stay confirmed between
    two checks, so the worker-start check names the least ttl that works."""
    leader_of(patroni)
    app = eager_app(patroni.dsn(), "fence-start", patroni_url=patroni.urls)

    @app.task(base=TenantLockedTask, lock_name="start:{tenant}", shared=False)
    def step(tenant: str) -> None:
        return None

    assert configuration_problems(app) == []  # the tests' timing fits
    with timing(patroni, ttl=26, loop_wait=10, retry_timeout=5):
        # The check before read the timing into the fence's cache, kept up to its
        # config_max_age: the new timing is read once that has run out.
        [problem] = wait_until(
            lambda: configuration_problems(app), 30, "the new timing read by the fence"
        )
    assert problem.startswith("pglock_patroni_url: Patroni's ttl 26 s"), problem
    assert "raise ttl to at least 30" in problem, problem


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


@pytest.fixture(scope="module")
def outsider(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedPostgres]:
    """A read-write Postgres that no member of the cluster runs (what a rogue or deposed
    primary is to the fence), logging every statement it is sent."""
    server = EmbeddedPostgres(tmp_path_factory.mktemp("outsider"))
    server.init("log_statement = 'all'")
    server.start()
    try:
        yield server
    finally:
        server.destroy()


def first_in_line(outsider: EmbeddedPostgres, cluster: PatroniCluster) -> str:
    """The cluster's multi-host DSN with ``outsider`` first in its host list."""
    params = conninfo_to_dict(cluster.dsn())
    hosts = ["127.0.0.1", *str(params["host"]).split(",")]
    ports = [str(outsider.port), *str(params["port"]).split(",")]
    return make_conninfo(**{**params, "host": ",".join(hosts), "port": ",".join(ports)})


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_lock_is_never_tried_on_a_server_not_confirmed_as_leader_and_goes_on_to_the_leader(
    patroni: PatroniCluster, outsider: EmbeddedPostgres, strategy: str
) -> None:
    """Fence first. The outsider accepts writes and comes first in the host list, and a
    session there holds the name: a lock tried there would be refused (the tenant
    locked out while the leader is free), or granted and then thrown away. Instead no
    lock statement reaches it, and the lock is taken on the leader."""
    leader = leader_of(patroni)
    name = f"fence-first:{uuid.uuid4().hex[:8]}"
    with psycopg.connect(outsider.dsn, autocommit=True) as rogue:
        rogue.execute("SELECT pg_advisory_lock(%s)", (lock_key(name),))
        sent_before = outsider.log.read_text().count("pg_try_advisory_lock")
        for _ in range(3):  # a second and third lock reuse what the first learned
            held = lock(
                first_in_line(outsider, patroni), name, strategy=strategy,
                patroni_url=patroni.urls,
            )  # fmt: skip
            with held:
                assert held.acquired, held.loss
                assert held.holder() is not None
                if strategy in DEDICATED:
                    assert held.connection.info.port == leader.pg_port
    assert outsider.log.read_text().count("pg_try_advisory_lock") == sent_before


def test_a_lock_fails_fast_when_no_server_of_the_dsn_is_confirmed(
    patroni: PatroniCluster, outsider: EmbeddedPostgres
) -> None:
    """The outsider alone in the DSN: LockUnavailable naming it, nothing tried there."""
    leader_of(patroni)
    started = time.monotonic()
    held = lock(outsider.dsn, f"fence-first:{uuid.uuid4().hex[:8]}", patroni_url=patroni.urls)
    with pytest.raises(LockUnavailable) as refused:
        held.acquire()
    spent = time.monotonic() - started
    message = str(refused.value)
    assert f"127.0.0.1:{outsider.port}" in message, message
    assert "is confirmed as the Patroni cluster's leader" in message, message
    assert "no Patroni member answered for the lock session's server" in message, message
    assert spent < 10, spent  # the fence's three requests of 1 s, not a lockout


def wal_receivers(cluster: PatroniCluster, leader: Member) -> list[int]:
    """The pids of every standby's WAL receiver (what streams the leader's WAL to it)."""
    pids = []
    for member in (m for m in cluster.members if m is not leader):
        postmaster = member.postmaster_pid()
        assert postmaster is not None
        for child in psutil.Process(postmaster).children():
            with contextlib.suppress(psutil.Error):
                if "walreceiver" in " ".join(child.cmdline()):
                    pids.append(child.pid)
    return pids


def test_a_commit_waiting_on_cut_replication_is_bounded_and_says_its_outcome_is_unknown(
    patroni: PatroniCluster,
) -> None:
    """Replication cut (every standby's WAL receiver paused) while the leader keeps its
    key: under synchronous_mode_strict its commits wait as long as the cut lasts. The
    holder's COMMIT in lock.transaction() gives up at the statement deadline with
    LockLost saying whether it committed is unknown; the name stays held meanwhile, and
    the commit goes through once replication returns."""
    leader = leader_of(patroni)
    patroni.wait_healthy(60)
    name = f"sync-cut:{uuid.uuid4().hex[:8]}"
    with psycopg.connect(leader.dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE IF NOT EXISTS sync_cut (name text NOT NULL)")

    def written() -> bool:
        with psycopg.connect(leader.dsn) as conn:
            row = conn.execute("SELECT count(*) FROM sync_cut WHERE name = %s", (name,)).fetchone()
        return bool(row and row[0])

    held = lock(patroni.dsn(), name, patroni_url=patroni.urls)
    assert held.acquire(), held.loss
    receivers = wal_receivers(patroni, leader)
    assert len(receivers) == len(patroni.members) - 1, receivers
    for pid in receivers:
        os.kill(pid, signal.SIGSTOP)
    try:
        with pytest.raises(LockLost) as lost:
            with held.transaction() as conn:
                conn.execute("INSERT INTO sync_cut VALUES (%s)", (name,))
        message = str(lost.value)
        assert f"did not answer the COMMIT within {STATEMENT_DEADLINE:g} s" in message, message
        assert "whether the transaction committed is unknown" in message, message
        assert not free_elsewhere(leader.dsn, name)  # its backend still waits, holding it
        assert not written()
    finally:
        for pid in receivers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        with contextlib.suppress(LockLost):
            held.release()
    wait_until(written, 30, "the waiting commit to go through")
    wait_until(lambda: free_elsewhere(leader.dsn, name), 30, "the name to be free")


def test_a_refused_server_is_named_when_the_next_host_cannot_be_reached(
    patroni: PatroniCluster, outsider: EmbeddedPostgres
) -> None:
    leader_of(patroni)
    closed = free_port()
    dsn = make_conninfo(
        outsider.dsn, host="127.0.0.1,127.0.0.1", port=f"{outsider.port},{closed}",
        connect_timeout="2",
    )  # fmt: skip
    held = lock(dsn, f"fence-first:{uuid.uuid4().hex[:8]}", patroni_url=patroni.urls)
    with pytest.raises(LockUnavailable) as refused:
        held.acquire()
    message = str(refused.value)
    assert f"127.0.0.1:{outsider.port}: " in message, message  # refused, and why
    assert f"127.0.0.1:{closed}" in message, message  # then unreachable
