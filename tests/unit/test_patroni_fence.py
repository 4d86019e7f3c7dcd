"""The Patroni leader fence: the setting's parsing, the trust window, the verdicts.

The fence talks HTTP to a scripted server in a thread here (a real socket and urllib);
tests/failover/test_leader_fence.py runs it against a real Patroni cluster.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import math
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pglock_celery.config import load_config
from pglock_celery.exceptions import ConfigurationError
from pglock_celery.leader import ServerIdentity
from pglock_celery.patroni import (
    Answer,
    LeaderFence,
    Timing,
    TimingRejected,
    fenced_check_interval,
    judge,
    parse_urls,
    shortest_ttl,
)

STARTED = datetime.datetime(2026, 12, 1, 9, 0, 0, 123456, tzinfo=datetime.timezone.utc)
SERVER = ServerIdentity("127.0.0.1", 5432, STARTED)
TIMING = Timing(ttl=20, loop_wait=2, retry_timeout=4)


def leader_body(**changes: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "state": "running",
        "postmaster_start_time": str(STARTED),
        "role": "primary",
        "timeline": 1,
        "dcs_last_seen": 1_000,
        "patroni": {"version": "4.1.5", "scope": "demo", "name": "m0"},
    }
    body.update(changes)
    return body


def answer(status: int = 200, age: float = 1.0, **changes: Any) -> Answer:
    return Answer(status, 1_000 + age, leader_body(**changes))


# -- the setting ---------------------------------------------------------------------


def test_urls_are_split_on_commas_stripped_and_deduplicated() -> None:
    assert parse_urls(" http://10.0.0.1:8008/ ,https://db2:8008,http://10.0.0.1:8008") == (
        "http://10.0.0.1:8008",
        "https://db2:8008",
    )
    assert parse_urls(["http://a:1", "http://b:2"]) == ("http://a:1", "http://b:2")


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ("ftp://a:1", "must start with http"),
        ("http://a:1,,http://b:2", "URL 2 is empty"),
        ("http://:8008", "no host"),
        ("http://a:notaport", "does not parse"),
        ("http://a:1/?x=1", "query or fragment"),
        (8008, "comma-separated"),
    ],
)
def test_bad_urls_are_refused_saying_why(raw: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_urls(raw)


def test_a_url_with_credentials_is_refused_without_quoting_them() -> None:
    with pytest.raises(ValueError, match="credentials") as refused:
        parse_urls("http://admin:s3cret@10.0.0.1:8008")
    assert "s3cret" not in str(refused.value)
    with pytest.raises(ConfigurationError) as invalid:
        load_config({"pglock_patroni_url": "http://admin:s3cret@10.0.0.1:8008"}, {})
    assert "s3cret" not in str(invalid.value)
    assert "pglock_patroni_url" in str(invalid.value)


def test_the_setting_comes_from_app_conf_or_pglock_patroni_url_and_defaults_to_none() -> None:
    assert load_config({}, {}).patroni_url is None
    from_env = load_config({}, {"PGLOCK_PATRONI_URL": "http://a:8008,http://b:8008"})
    assert from_env.patroni_url == ("http://a:8008", "http://b:8008")
    from_conf = load_config({"pglock_patroni_url": ["http://c:8008"]}, {})
    assert from_conf.patroni_url == ("http://c:8008",)
    with pytest.raises(ConfigurationError, match="PGLOCK_PATRONI_URL"):
        load_config({}, {"PGLOCK_PATRONI_URL": "10.0.0.1:8008"})


# -- the window ----------------------------------------------------------------------


def test_the_window_is_ttl_less_loop_wait_less_the_longer_of_retry_and_stale_read_less_margin() -> (
    None
):
    assert Timing(20, 2, 4).window(margin=1) == 20 - 2 - 5 - 1  # stale read 4 s + 1
    assert Timing(30, 10, 10).window(margin=1) == 30 - 10 - 13 - 1
    assert Timing(40, 2, 10).window(margin=1) == 40 - 2 - 10 - 1


def test_a_fenced_check_interval_fits_patronis_defaults_and_is_never_raised() -> None:
    """At 30/10/10 the window is 5 s: the default interval (2 s) needs 1.25 * 2 + 3 s plus
    a timeout, so it is lowered to (5 - 4) / 1.25 = 0.8 s; a wide window keeps it."""
    defaults = Timing(30, 10, 10)
    assert fenced_check_interval(defaults, wanted=2.0, timeout=1.0, margin=2.0) == 0.8
    assert fenced_check_interval(Timing(20, 2, 4), wanted=2.0, timeout=1.0, margin=2.0) == 2.0
    assert fenced_check_interval(defaults, wanted=0.3, timeout=1.0, margin=2.0) == 0.3


@given(
    ttl=st.integers(20, 120),
    loop_wait=st.integers(1, 30),
    retry_timeout=st.integers(1, 30),
    wanted=st.floats(0.1, 30),
    latency=st.floats(0.0, 1.0),
)
def test_a_confirmation_that_came_within_its_timeout_outlasts_the_next_check_and_its_ask(
    ttl: int, loop_wait: int, retry_timeout: int, wanted: float, latency: float
) -> None:
    """Whatever the timing, a confirmation whose answer took up to the request timeout
    is still valid, once it is in, until the next check (within 1.25 intervals, from
    the end of this one) has asked again (3 requests): no lock is refused for a slow
    but timely Patroni."""
    timing, timeout = Timing(ttl, loop_wait, retry_timeout), 1.0
    interval = fenced_check_interval(timing, wanted=wanted, timeout=timeout, margin=2.0)
    if interval is None:
        return
    assert interval <= wanted
    remaining = timing.window(2.0) - latency  # trusted from when the request was sent
    assert remaining >= 1.25 * interval + 3 * timeout


def test_no_check_interval_fits_a_window_too_short_and_the_least_ttl_is_named() -> None:
    short = Timing(28, 10, 10)  # window 3 s: (3 - 4) / 1.25 < 0.5
    assert fenced_check_interval(short, wanted=2.0, timeout=1.0, margin=2.0) is None
    least = shortest_ttl(short, timeout=1.0, margin=2.0)
    assert least == 30  # 25 s of loop_wait, retries and margin + 0.625 + 4, whole seconds
    fitted = Timing(least, 10, 10)
    assert fenced_check_interval(fitted, wanted=2.0, timeout=1.0, margin=2.0) is not None
    assert (
        fenced_check_interval(Timing(least - 1, 10, 10), wanted=2.0, timeout=1.0, margin=2.0)
        is None
    )


def test_patronis_defaults_fill_in_absent_keys_and_what_patroni_rejects_is_refused() -> None:
    assert Timing.from_config({}) == Timing(30, 10, 10)
    assert Timing.from_config({"ttl": "20", "loop_wait": 2}) == Timing(20, 2, 10)
    assert Timing.from_config({"ttl": 20.9}).ttl == 20  # the lease gets int(ttl)
    # int() of each raises in Patroni's Config._validate_and_adjust_timeouts, and a
    # loop_wait or retry_timeout kept as text or a bool is no number its loop can use.
    for bad in ({"ttl": True}, {"loop_wait": [2]}, {"ttl": "1e2"}, {"ttl": "20.5"},
                {"ttl": "1e400"}, {"ttl": 10**400}, {"ttl": math.inf}, {"loop_wait": "2"},
                {"loop_wait": "nan"}, {"retry_timeout": "inf"}, {"retry_timeout": math.nan},
                {"loop_wait": False}):  # fmt: skip
        with pytest.raises(TimingRejected):
            Timing.from_config(bad)
    with pytest.raises(ValueError, match="not a JSON object"):
        Timing.from_config([])


@pytest.mark.parametrize(
    ("config", "narrowest", "runs_with"),
    [
        # Raised to the minimums (loop_wait 1, retry_timeout 3, ttl 20), ttl as its int.
        ({"ttl": 20, "loop_wait": 0.25, "retry_timeout": 2}, (20, 1, 3),
         {"loop_wait": 1, "retry_timeout": 3}),
        ({"ttl": 0, "loop_wait": -1, "retry_timeout": 3}, (0, 1, 3),
         {"ttl": 20, "loop_wait": 1}),
        # loop_wait + 2 * retry_timeout > ttl: loop_wait lowered, never trusted for it.
        ({"ttl": 20, "loop_wait": 5, "retry_timeout": 9}, (20, 5, 9), {"loop_wait": 2}),
        # ... and with loop_wait at 1 already, retry_timeout lowered to (ttl - 1) // 2.
        ({"ttl": 20, "loop_wait": 1, "retry_timeout": 12}, (20, 1, 12), {"retry_timeout": 9}),
        # Floats Patroni keeps as they are (its rule compares their ints).
        ({"ttl": 25.9, "loop_wait": 2.5, "retry_timeout": 4.5}, (25, 2.5, 4.5), {}),
    ],
)  # fmt: skip
def test_timings_are_read_as_patroni_runs_with_them_and_never_trusted_longer_than_given(
    config: dict[str, Any], narrowest: tuple[float, float, float], runs_with: dict[str, float]
) -> None:
    timing = Timing.from_config(config)
    assert (timing.ttl, timing.loop_wait, timing.retry_timeout) == narrowest
    assert dict(timing.runs_with) == runs_with
    assert len(timing.changes) == len(runs_with)


# -- the verdict on one answer ---------------------------------------------------------


def test_a_leader_answer_is_trusted_from_when_the_request_was_sent() -> None:
    verdict = judge(answer(), SERVER, sent_at=100.0, timing=TIMING, margin=1.0, member="m")
    assert verdict.leader and verdict.member == "m0"
    assert verdict.until == 100.0 + TIMING.window(1.0)
    assert verdict.valid(now=100.0 + TIMING.window(1.0) - 0.01)
    assert not verdict.valid(now=100.0 + TIMING.window(1.0))
    assert not verdict.valid(now=100.0, for_at_least=TIMING.window(1.0))


@pytest.mark.parametrize(
    ("given", "reason"),
    [
        (answer(503, role="replica"), "not the leader: Patroni says"),
        (answer(postmaster_start_time=str(STARTED + datetime.timedelta(seconds=1))), "another"),
        (answer(postmaster_start_time=None, state="stopped"), "not running"),
        (answer(role="replica"), "not the leader: its Postgres is replica"),
        (answer(state="starting"), "not the leader"),
        (answer(cluster_unlocked=True), "no leader or has expired"),
        (answer(failsafe_mode_is_active=True), "failsafe"),
        (answer(age=TIMING.stale + 1), "HA loop last read the DCS 5 s ago"),
        (Answer(200, None, leader_body()), "Date header"),
        (answer(dcs_last_seen=None), "dcs_last_seen"),
        (Answer(0, None, None, "timed out"), "cannot tell: no answer (timed out)"),
        (Answer(502, 1000.0, None), "cannot tell: HTTP 502"),
    ],
)
def test_an_answer_that_does_not_prove_leadership_is_refused(given: Answer, reason: str) -> None:
    verdict = judge(given, SERVER, sent_at=100.0, timing=TIMING, margin=1.0, member="10.0.0.1:1")
    assert not verdict.leader and verdict.until == 0.0
    assert reason in verdict.reason
    assert "10.0.0.1:1" in verdict.reason


def test_a_loop_read_as_old_as_allowed_is_still_trusted() -> None:
    verdict = judge(answer(age=TIMING.stale), SERVER, 0.0, TIMING, 1.0, "m")
    assert verdict.leader


def test_a_ttl_too_short_for_the_loop_confirms_nothing() -> None:
    verdict = judge(answer(), SERVER, 0.0, Timing(10, 5, 4), 1.0, "m")
    assert not verdict.leader and "too short" in verdict.reason


# -- the fence over HTTP ---------------------------------------------------------------


class Member:
    """A scripted Patroni REST API on a loopback port: /leader and /config."""

    def __init__(self, body: dict[str, Any], status: int = 200) -> None:
        self.body, self.status = body, status
        self.config: dict[str, Any] = {"ttl": 20, "loop_wait": 2, "retry_timeout": 4}
        self.requests: list[str] = []
        member = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                member.requests.append(self.path)
                if self.path == "/config":
                    code, payload = 200, member.config
                else:
                    code = member.status
                    payload = dict(member.body, dcs_last_seen=int(time.time()))
                data = json.dumps(payload).encode()
                self.send_response(code)  # adds the Date header, as Patroni's does
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def members() -> Iterator[list[Member]]:
    started = [
        Member(leader_body()),
        Member(
            leader_body(
                role="replica",
                postmaster_start_time=str(STARTED + datetime.timedelta(seconds=5)),
                patroni={"scope": "demo", "name": "m1"},
            ),
            status=503,
        ),
    ]
    yield started
    for member in started:
        member.close()


def test_the_fence_finds_the_member_running_the_server_and_confirms_it(
    members: list[Member],
) -> None:
    fence = LeaderFence([m.url for m in reversed(members)])
    before = time.monotonic()
    verdict = fence.confirm(SERVER)
    assert verdict.leader and verdict.member == "m0"
    assert before + TIMING.window(fence.margin) <= verdict.until
    assert verdict.until <= time.monotonic() + TIMING.window(fence.margin)
    replica = ServerIdentity("127.0.0.1", 5433, STARTED + datetime.timedelta(seconds=5))
    refused = fence.confirm(replica)
    assert not refused.leader and "not the leader" in refused.reason


def test_a_confirmation_is_reused_while_it_stays_valid_long_enough(members: list[Member]) -> None:
    fence = LeaderFence([members[0].url])
    first = fence.confirm(SERVER)
    asked = len(members[0].requests)
    assert fence.confirm(SERVER, fresh_for=1.0) is first
    assert len(members[0].requests) == asked
    again = fence.confirm(SERVER, fresh_for=TIMING.window(fence.margin))
    assert again.leader and again is not first
    assert len(members[0].requests) == asked + 1


def test_the_configuration_is_read_again_once_older_than_its_max_age(
    members: list[Member],
) -> None:
    now = [1000.0]
    fence = LeaderFence([members[0].url], config_max_age=5.0, clock=lambda: now[0])
    assert fence.confirm(SERVER).until == 1000.0 + 11.0
    members[0].config = {"ttl": 30, "loop_wait": 2, "retry_timeout": 4}
    now[0] += 4.0
    assert fence.confirm(SERVER, fresh_for=20).until == 1004.0 + 11.0  # cached timing
    now[0] += 2.0
    assert fence.confirm(SERVER, fresh_for=20).until == 1006.0 + 21.0
    assert members[0].requests.count("/config") == 2


def test_a_member_that_accepts_but_never_answers_is_cannot_tell_within_the_timeout(
    members: list[Member],
) -> None:
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)  # the kernel accepts; nothing ever answers (a paused Patroni)
    try:
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        fence = LeaderFence([members[0].url, url], timeout=0.5)
        elsewhere = ServerIdentity("127.0.0.1", 5439, STARTED + datetime.timedelta(hours=1))
        began = time.monotonic()
        verdict = fence.confirm(elsewhere)
        took = time.monotonic() - began
    finally:
        silent.close()
    assert not verdict.leader
    assert "cannot tell" in verdict.reason and "timed out" in verdict.reason
    assert took < 1.5


def test_a_member_that_timed_out_is_refused_at_once_until_it_may_be_asked_again() -> None:
    """A paused member costs one timeout per ``silent_for``, not one per lock taken."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)  # the kernel accepts; nothing ever answers (a paused Patroni)
    now = [1000.0]
    took: list[float] = []
    verdicts = []
    try:
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        fence = LeaderFence([url], timeout=0.3, silent_for=2.0, clock=lambda: now[0])
        for advance in (0.0, 1.9, 0.2):  # asked; within silent_for; past it
            now[0] += advance
            began = time.monotonic()
            verdicts.append(fence.confirm(SERVER))
            took.append(time.monotonic() - began)
    finally:
        silent.close()
    assert not any(v.leader for v in verdicts)
    assert took[0] >= 0.3 and "timed out" in verdicts[0].reason
    assert took[1] < 0.1 and "a moment ago" in verdicts[1].reason, (took, verdicts[1])
    assert took[2] >= 0.3 and "timed out" in verdicts[2].reason


def test_nobody_answering_for_the_server_is_cannot_tell_naming_it(members: list[Member]) -> None:
    fence = LeaderFence([members[1].url])
    verdict = fence.confirm(SERVER)
    assert not verdict.leader
    assert "cannot tell" in verdict.reason and "127.0.0.1:5432" in verdict.reason


def test_members_of_two_clusters_are_refused(members: list[Member]) -> None:
    members[1].body["patroni"] = {"scope": "other", "name": "x"}
    fence = LeaderFence([members[1].url, members[0].url])
    fence.confirm(ServerIdentity("h", 1, STARTED + datetime.timedelta(seconds=5)))
    verdict = fence.confirm(SERVER)
    assert not verdict.leader and "more than one Patroni cluster" in verdict.reason


def test_a_proxy_in_the_environment_is_not_used(
    members: list[Member], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("http_proxy", "http://127.0.0.1:9")  # nothing listens there
    monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:9")
    monkeypatch.delenv("no_proxy", raising=False)
    monkeypatch.delenv("NO_PROXY", raising=False)
    assert LeaderFence([members[0].url]).confirm(SERVER).leader


def test_a_forked_child_asks_the_members_on_threads_and_a_mutex_of_its_own(
    members: list[Member],
) -> None:
    """The parent searched on the client's pool, and one of its threads held the
    client's mutex at the fork: the child, once told of the fork, searches all the same."""
    fence = LeaderFence([m.url for m in members])
    assert fence.confirm(SERVER).leader  # not known yet: every member asked, on the pool
    replica = ServerIdentity("127.0.0.1", 5433, STARTED + datetime.timedelta(seconds=5))
    with fence._client._guard:  # as a thread of the parent's would, at the fork
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                fence.after_fork_in_child()
                code = 0 if "not the leader" in fence.confirm(replica).reason else 2
            finally:
                os._exit(code)
    deadline = time.monotonic() + 20
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)  # polling the child's exit, with a deadline
    if done[0] == 0:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pytest.fail("the forked child's confirm hung")
    assert os.waitstatus_to_exitcode(done[1]) == 0


@contextlib.contextmanager
def silent_member() -> Iterator[str]:
    """A member whose host accepts connections and never answers (cut off, paused)."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    try:
        yield f"http://127.0.0.1:{silent.getsockname()[1]}"
    finally:
        silent.close()


@pytest.mark.parametrize("silent_first", [False, True], ids=["listed-last", "listed-first"])
def test_the_member_that_runs_the_server_decides_without_waiting_for_a_silent_one(
    members: list[Member], silent_first: bool
) -> None:
    """A first lock (the member running the server not known yet) asks every member,
    for the configuration too: the first answer decides as it comes, wherever the silent
    member is listed, and the confirmation lasts its window."""
    with silent_member() as silent:
        urls = [silent, members[0].url] if silent_first else [members[0].url, silent]
        fence = LeaderFence(urls, timeout=1.0)
        sent = time.monotonic()
        verdict = fence.confirm(SERVER)
        answered = time.monotonic()
    assert verdict.leader, verdict.reason
    assert answered - sent < 0.9  # not the silent member's timeout
    assert verdict.until >= sent + TIMING.window(fence.margin)


@pytest.mark.parametrize(
    "reply",
    [
        b'HTTP/1.1 200 OK\r\nContent-Length: 500\r\n\r\n{"role": "primary"',  # cut short
        b"SSH-2.0-OpenSSH_9.2\r\n",  # not HTTP at all
    ],
    ids=["cut-short", "not-http"],
)
def test_a_reply_that_is_not_whole_http_is_no_answer_never_an_error(reply: bytes) -> None:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)

    def serve() -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, _ = server.accept()
                with conn:
                    conn.recv(4096)
                    conn.sendall(reply)

    threading.Thread(target=serve, daemon=True).start()
    try:
        fence = LeaderFence([f"http://127.0.0.1:{server.getsockname()[1]}"], timeout=1.0)
        verdict = fence.confirm(SERVER)
    finally:
        server.close()
    assert not verdict.leader
    assert verdict.reason.startswith("cannot tell"), verdict.reason


def test_a_member_that_never_completes_the_tls_handshake_is_no_answer_within_the_timeout() -> None:
    with silent_member() as url:
        fence = LeaderFence([url.replace("http://", "https://")], timeout=0.5)
        began = time.monotonic()
        answer = fence.status(fence.urls[0], "/patroni")
        took = time.monotonic() - began
    assert answer.status == 0 and answer.timed_out, answer
    assert 0.5 <= took < 0.75


def test_an_answer_on_a_connection_kept_open_is_read_to_its_content_length_at_once() -> None:
    """A member that keeps the connection open after its answer (HTTP/1.1 keep-alive,
    whatever ``Connection: close`` asked) is read up to its Content-Length, not until
    the deadline."""

    class KeepAlive(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:
            payload = json.dumps(leader_body()).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(payload)))
            self.send_header("Connection", "keep-alive")
            self.end_headers()
            self.wfile.write(payload)
            self.close_connection = False

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), KeepAlive)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    try:
        fence = LeaderFence([f"http://127.0.0.1:{server.server_address[1]}"], timeout=2.0)
        began = time.monotonic()
        answer = fence.status(fence.urls[0], "/patroni")
        took = time.monotonic() - began
    finally:
        server.shutdown()
        server.server_close()
    assert answer.status == 200 and answer.body == leader_body()
    assert answer.date is not None
    assert took < 0.5
