"""Patroni as the leader source (leader.py): whether a server leads, and until when to trust it.

A session advisory lock lives on one Postgres server. After a failover the new primary
knows nothing of it, and an old primary that still runs (its Patroni killed, paused or
cut off) keeps serving its sessions. With ``pglock_patroni_url`` set, a lock is valid
only while :class:`LeaderFence` has recently confirmed that its server holds Patroni's
leader key; a confirmation is trusted until a monotonic deadline that comes before any
other member can be promoted.

Safety argument (verified against Patroni 4.1.5's source, etcd3 DCS)
--------------------------------------------------------------------
Facts, with where they live in Patroni:

F1  The leader key sits on an etcd lease of ``ttl`` seconds that only the leader's own
    HA loop renews: ``Ha.update_lock`` (ha.py) -> ``Etcd3._update_leader``
    (dcs/etcd3.py) -> ``_do_refresh_lease(force=True)`` (a lease keepalive). Another
    member takes the key only once it is gone: ``_do_attempt_to_acquire_leader`` puts
    it with ``create_revision='0'``, and since Patroni's PR 2689 (May 2023) a resumed
    old leader re-creates it only when absent, never over another's (the txn in
    ``_update_leader`` compares the key's VALUE with its own name, else
    ``create_revision == 0``). So no member but L can hold the key before L's lease
    expires, ``ttl`` seconds (etcd's clock) after the last keepalive etcd processed.
F2  ``GET /leader`` (api.py ``do_GET``) answers 200 when ``Ha.is_leader()``, which is
    ``_leader_expiry > time.time()``; ``set_is_leader(True)`` sets
    ``_leader_expiry = time.time() + ttl`` right after a successful update, and a failed
    update, a lost key or a demotion sets it to 0 at once (``update_lock``,
    ``load_cluster_from_dcs``, ``_delete_leader``, ``demote``). So a 200 proves only that
    some renewal succeeded less than ``ttl`` ago: given up to ``ttl`` after the last
    renewal, it may come when the lease has already expired. A 200 alone is not enough.
F3  Every status answer carries ``dcs_last_seen`` (``AbstractDCS.get_cluster``:
    ``int(time.time())`` at the HA loop's read of the DCS, the first step of each
    cycle) and an HTTP ``Date`` header (``BaseHTTPRequestHandler``): both from the
    Patroni host's clock, so their difference is the age of the loop's last DCS read,
    measured on one clock, within 1 s either way (both are whole seconds).
F4  An HA cycle starts at most ``loop_wait`` after the previous one began (or at once
    when it overran, ``Patroni.schedule_next_run``); a renewal that cannot reach etcd
    gives up after ``retry_timeout`` (its ``Retry`` deadline) and then clears
    ``is_leader()``. ``cluster_unlocked`` is in the answer when the member's cached view
    of the DCS has no leader or has expired; ``failsafe_mode_is_active`` when it leads
    without the key (failsafe mode).
F5  A member promotes only after winning the race for the key (``_is_healthiest_node``
    also refuses while another member's REST API still reports a running primary,
    "Primary (%s) is still alive"), then runs ``pg_ctl promote``: its first lock comes
    later still. Neither delay is counted below.

The fence: for the session's server (identified by its postmaster's start time, which
every status answer carries and which changes at every restart), GET ``/leader`` on the
member that runs it, sent at monotonic time ``t0`` (our clock). It confirms only a
200 answer naming that postmaster, role ``primary``, state ``running``, neither
``cluster_unlocked`` nor ``failsafe_mode_is_active``, and a loop read age (F3) of at
most ``stale = loop_wait + 2`` s, measured. The confirmation holds until

    t0 + W,  W = ttl - loop_wait - max(retry_timeout, stale + 1) - margin

with ttl, loop_wait and retry_timeout read from ``GET /config`` (Patroni's dynamic
configuration; its defaults 30/10/10 when a key is absent) as Patroni itself reads them,
and never for more than their face value (``Timing.from_config``: a configuration
Patroni rejects confirms nothing, a value it raises or lowers counts at the narrower of
the two), re-read every
``config_max_age`` seconds; ``margin`` (2 s) absorbs the time a cycle takes before its
renewal, a keepalive's round trip and clock-rate error. Why no member can be promoted
before ``t0 + W``: the answer was computed at some ``t >= t0``; let ``r`` be the last
keepalive etcd processed for L's lease before ``t``.
(a) The loop is keeping time: the cycle after ``r``'s began within ``loop_wait`` of
    ``r``'s cycle and renews or fails within ``retry_timeout`` (F4), a failure clearing
    ``is_leader()`` at once (F2). So a 200 at ``t`` means ``r >= t - loop_wait -
    retry_timeout - margin``, and the lease outlives ``t0 + W`` (F1).
(b) The loop is stalled (busy in one cycle): the age check (F3) refuses every answer
    once its last read is more than ``stale + 1`` s old, so confirmations stop within
    ``stale + 1`` s of that read; as its renewal followed the read, the lease outlives
    ``t0 + W`` again, and a stall before the renewal is case (a) for the cycle before.
So while a confirmation is valid, L holds the key and nobody else can be promoted (F1,
F5). ``ttl 20, loop_wait 2, retry_timeout 4`` give W = 11 s; Patroni's defaults
``30/10/10`` give W = 5 s. A holder on a deposed primary is told within W of its last
confirmation, provided its library refreshes the confirmation before it ends and treats
an ended one as a loss (what the lock core does with ``LeaderFence.confirm``, checking
each lock often enough for that: ``fenced_check_interval``, 0.8 s at the defaults).

Assumptions:
A1  Clocks tick at nearly the same rate (etcd's, the Patroni host's, this host's), and
    the Patroni host's wall clock is not stepped by more than the margin while it leads
    (``is_leader()`` and F3 use ``time.time()``). No synchronised clocks are needed: only
    durations, each measured on a single clock.
A2  Patroni has the fix of PR 2689 (any 3.0.3 or later; tested: 4.1.5) and uses etcd v3
    (F1 was read for it; other DCSs hold keys on sessions whose expiry differs).
A3  The leader's HA loop does not, in one cycle, spend more than ``loop_wait + margin``
    after its renewal and then, in the next, stall between its DCS read and its renewal
    for longer than the margin (a stall while Postgres hangs does not count: the REST
    answer then hangs too). Patroni warns "Loop time exceeded" when a cycle overruns.
    And nobody calls ``GET /cluster`` on the leader's REST API often enough to hide a
    stalled loop: that endpoint reads the DCS from the REST thread and refreshes
    ``dcs_last_seen`` (api.py ``do_GET_cluster``; ``patronictl`` reads etcd directly, and
    HAProxy's checks and the other members' ``/patroni`` calls do not read it).
A4  Lowering ``ttl`` (or raising ``loop_wait`` / ``retry_timeout``) takes effect for the
    fence at its next ``/config`` read: change it in steps no larger than the margin,
    or with no lock held.
A5  The URLs name every member of one cluster (once two scopes have answered, nothing is
    confirmed).

Failsafe mode (``failsafe_mode: true``): why nothing is confirmed during a DCS outage
-------------------------------------------------------------------------------------
Read in Patroni 4.1.5's ha.py and api.py. With failsafe mode a primary that cannot reach
the DCS keeps running if every other member accepts its ``POST /failsafe``:

S1  On a DCS error the leader's HA loop (``Ha._handle_dcs_error``) calls
    ``check_failsafe_topology``: a POST to every member named in the ``/failsafe`` key
    (its last copy of the DCS); if all accept, ``set_is_leader(True)`` (``GET /leader``
    answers 200 for ``ttl`` more seconds, F2) and ``Failsafe.set_is_active(time.time())``
    (``failsafe_mode_is_active`` in its answers for ``ttl`` seconds); else it demotes.
S2  A replica that accepts the POST records its time (``Failsafe.update``); for ``ttl``
    seconds after it (``Failsafe.leader``), ``load_cluster_from_dcs`` puts that leader
    into its view of a cluster whose key expired, so it does not race for the key. Once
    those ``ttl`` seconds pass without a POST, a replica that reaches the DCS races, and
    a leader it cannot reach does not hold it back (F5's "still alive" needs an answer).
S3  The answers say nothing of when the last failsafe round ran: ``dcs_last_seen`` stays
    at the last successful DCS read (``AbstractDCS.get_cluster`` fails), and a 200 or
    ``failsafe_mode_is_active`` only say that a round ended less than ``ttl`` ago.
    ``GET /config`` is answered from the DCS: the REST thread waits on it (no answer).

A window would need, as (a) and (b) give above, a bound on how long ago the replicas'
holds (S2) were renewed. The leader's 200 (S1) and each replica's hold (S2) last the same
``ttl`` from one round, the hold from its POST, which came first: a 200 at ``t`` leaves
no time at all after ``t`` in the worst case. With the loop keeping time the last round
is recent (case (a)), but a loop stalled after a round (case (b)) cannot be told apart:
the age check that bounds (b) has nothing to measure (S3). Nor can the fence tell a DCS
down for everyone (nobody can take the key then) from a leader cut off from a DCS that
the replicas still reach, where a replica that lost the leader's POSTs is promoted
``ttl`` after the last one (S2). So no window is proven: while a member reports
``failsafe_mode_is_active``, or its loop's DCS read is older than ``stale`` (which any
outage reaches first), nothing is confirmed and the refusal names the DCS outage and
failsafe mode (``DCS_OUTAGE``); a held lock is lost within W of its last confirmation.
Locks are granted again once the leader reads the DCS again (docs/limits.md, limit 36).

Messages never contain a URL's userinfo or query: members are named by host and port.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import datetime
import email.message
import email.utils
import functools
import http.client
import io
import json
import math
import os
import socket
import ssl
import threading
import time
import urllib.parse
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import psycopg

from .leader import Confirmation, ServerIdentity, Standing, server_identity
from .tls import TLS_SETTINGS, tls_context, tls_reason

__all__ = [
    "LeaderFence",
    "MemberClient",
    "Timing",
    "fenced_check_interval",
    "parse_urls",
    "shortest_ttl",
    "shown",
]

T = TypeVar("T")

#: Patroni's defaults for the dynamic configuration keys the window depends on.
PATRONI_DEFAULTS = {"ttl": 30.0, "loop_wait": 10.0, "retry_timeout": 10.0}
#: The least value Patroni runs with for each (config.py ``_validate_and_adjust_timeouts``).
PATRONI_MINIMUMS = {"ttl": 20, "loop_wait": 1, "retry_timeout": 3}
#: A fenced lock's check interval is lowered to fit the cluster's window, never below this.
SHORTEST_FENCED_INTERVAL = 0.5


def fenced_check_interval(
    timing: Timing, *, wanted: float, timeout: float, margin: float
) -> float | None:
    """The check interval of a fenced lock under ``timing``: ``wanted``, or less.

    Each check needs a confirmation that outlasts the next check (which comes within
    1.25 intervals of this one's end) and the time to ask then (three requests of
    ``timeout``), counted from when the answer just received is in: a confirmation is
    trusted from when its request was sent, and an answer may take up to ``timeout``.
    So the interval is at most ``(window - 4 * timeout) / 1.25``: a slow but timely
    Patroni never costs a lock. None when that is below SHORTEST_FENCED_INTERVAL: no
    check interval works, Patroni's ttl must grow.
    """
    fits = (timing.window(margin) - 4 * timeout) / 1.25
    if fits < SHORTEST_FENCED_INTERVAL:
        return None
    return min(wanted, fits)


def shortest_ttl(timing: Timing, *, timeout: float, margin: float) -> float:
    """The least ttl with which ``timing``'s loop_wait and retry_timeout leave room for
    a fenced lock (fenced_check_interval not None), in whole seconds."""
    needed = 1.25 * SHORTEST_FENCED_INTERVAL + 4 * timeout
    return float(math.ceil(timing.ttl - timing.window(margin) + needed))


def parse_urls(raw: Any) -> tuple[str, ...]:
    """Return the members' REST API base URLs from the setting's value.

    ``raw`` is a comma-separated str (the environment's form) or a list of str. Each
    URL is ``http`` or ``https`` with a host, no credentials, query or fragment. Raises
    ValueError saying what is wrong, never quoting the value.
    """
    if isinstance(raw, str):
        items = raw.split(",")
    elif isinstance(raw, (list, tuple)) and all(isinstance(item, str) for item in raw):
        items = list(raw)
    else:
        raise ValueError("must be the Patroni REST API URLs, comma-separated")
    urls: list[str] = []
    for position, item in enumerate((item.strip() for item in items), start=1):
        if not item:
            raise ValueError(f"URL {position} is empty")
        try:
            parts = urllib.parse.urlsplit(item)
            port = parts.port
        except ValueError:
            raise ValueError(f"URL {position} does not parse (bad port?)") from None
        if parts.scheme not in ("http", "https"):
            raise ValueError(f"URL {position} must start with http:// or https://")
        if not parts.hostname:
            raise ValueError(f"URL {position} has no host")
        if parts.username is not None or parts.password is not None:
            raise ValueError(
                f"URL {position} holds credentials: Patroni's GET endpoints need none, remove them"
            )
        if parts.query or parts.fragment:
            raise ValueError(f"URL {position} has a query or fragment")
        del port  # read above only to validate it
        url = urllib.parse.urlunsplit((parts.scheme, parts.netloc, parts.path.rstrip("/"), "", ""))
        if url not in urls:
            urls.append(url)
    return tuple(urls)


def shown(url: str) -> str:
    """A member URL as messages show it: host and port only (never credentials)."""
    return _shown(url)


def _shown(url: str) -> str:
    """The member as messages name it: host and port only."""
    parts = urllib.parse.urlsplit(url)
    host = parts.hostname or "?"
    host = f"[{host}]" if ":" in host else host
    return f"{host}:{parts.port}" if parts.port else host


class TimingRejected(ValueError):
    """A dynamic configuration whose ``key`` Patroni cannot read (Timing.from_config)."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(message)
        self.key = key


@dataclasses.dataclass(frozen=True)
class Timing:
    """The Patroni settings the window depends on, from ``GET /config``, as Patroni runs
    with them (:meth:`from_config`); ``changes`` says what Patroni changes on the way."""

    ttl: float
    loop_wait: float
    retry_timeout: float
    #: Each value Patroni raises or lowers, as "loop_wait 0.25 to 1" (for the doctor).
    changes: tuple[str, ...] = dataclasses.field(default=(), compare=False)
    #: The values Patroni runs with, where they differ from the ones above: the fix.
    runs_with: tuple[tuple[str, float], ...] = dataclasses.field(default=(), compare=False)

    @classmethod
    def from_config(cls, config: Any) -> Timing:
        """Read ``ttl``, ``loop_wait`` and ``retry_timeout`` as Patroni 4.1.5 does, and
        never trust them for longer than they say.

        Patroni (config.py ``Config.set_dynamic_configuration``) first runs
        ``_validate_and_adjust_timeouts``: ``__get_and_maybe_adjust_int_value`` takes
        ``int(value)`` of each (a default from ``__DEFAULT_CONFIG`` when absent), and
        when that raises (``"1e2"``, ``"2.5"``, a list, infinity) the whole dynamic
        configuration is refused and the previous one stays in force: which one that
        is, ``/config`` cannot say, so ValueError (the fence then confirms nothing). A
        value under its minimum (loop_wait 1, retry_timeout 3, ttl 20) is replaced by
        the minimum; then, when ``loop_wait + 2 * retry_timeout > ttl`` (on those
        ints), loop_wait is lowered to ``ttl - 2 * retry_timeout``, or to 1 with
        retry_timeout ``(ttl - 1) // 2``. A value not replaced is used as it was given:
        the etcd lease gets ``int(ttl)`` (dcs/etcd.py ``AbstractEtcd.set_ttl``), the HA
        loop waits ``loop_wait`` (``Patroni.schedule_next_run``: ``next_run +=
        loop_wait``) and a DCS retry gives up after ``retry_timeout`` (``Retry``'s
        deadline, ``AbstractEtcd.set_retry_timeout``), floats included. So a loop_wait or
        retry_timeout given as text, which that arithmetic cannot use, is refused as
        well, and so is a JSON ``true`` (``int(True)`` is 1 to Patroni; nothing is
        trusted on such a doubtful reading).

        What Patroni runs with can differ from what ``/config`` says (a lower loop_wait,
        a higher ttl), and it only takes over at each member's next HA cycle (A4): the
        window is the narrower of the two readings, each of ttl the lower, of loop_wait
        and retry_timeout the higher.
        """
        if not isinstance(config, dict):
            raise ValueError("the dynamic configuration is not a JSON object")
        given: dict[str, float] = {}
        whole: dict[str, int] = {}
        for key, default in PATRONI_DEFAULTS.items():
            raw = config.get(key, default)
            text = f"{raw!r}"[:40]
            if isinstance(raw, bool) or (isinstance(raw, str) and key != "ttl"):
                raise TimingRejected(key, f"Patroni cannot use {key} {text}: not a number")
            try:
                whole[key] = int(raw)
                given[key] = float(whole[key] if key == "ttl" or isinstance(raw, str) else raw)
            except (TypeError, ValueError, OverflowError):
                raise TimingRejected(
                    key,
                    f"Patroni rejects this dynamic configuration ({key} {text} is not an "
                    "integer to it) and runs on with an earlier one, which GET /config does "
                    "not show",
                ) from None
        patroni = dict(given)
        for key, least in PATRONI_MINIMUMS.items():
            if whole[key] < least:
                patroni[key] = whole[key] = least
        ttl, loop_wait, retry = whole["ttl"], whole["loop_wait"], whole["retry_timeout"]
        if 1 + 2 * retry > ttl:
            patroni["loop_wait"], patroni["retry_timeout"] = 1, (ttl - 1) // 2
        elif loop_wait + 2 * retry > ttl:
            patroni["loop_wait"] = ttl - 2 * retry
        runs_with = tuple((k, float(v)) for k, v in patroni.items() if v != given[k])
        changes = tuple(f"{key} {given[key]:g} to {value:g}" for key, value in runs_with)
        return cls(
            min(given["ttl"], patroni["ttl"]),
            max(given["loop_wait"], patroni["loop_wait"]),
            max(given["retry_timeout"], patroni["retry_timeout"]),
            changes,
            runs_with,
        )

    @property
    def stale(self) -> float:
        """The most a confirmed answer's loop read may be aged, as measured (F3)."""
        return self.loop_wait + 2

    def window(self, margin: float) -> float:
        """Seconds a confirmation is trusted from when its request was sent."""
        return self.ttl - self.loop_wait - max(self.retry_timeout, self.stale + 1) - margin


@dataclasses.dataclass(frozen=True)
class Answer:
    """One HTTP answer of a member: status (0 when none came), Date header, JSON body."""

    status: int
    date: float | None
    body: Any
    error: str = ""
    #: No answer came within the timeout (what the fence acts on; ``error`` is for people).
    timed_out: bool = False
    #: TLS failed: the member's certificate is not trusted, or it refused ours (the
    #: doctor's cue that this is a certificate problem, not a silent member).
    tls: bool = False


def _loop_read_age(answer: Answer) -> float | None:
    seen = answer.body.get("dcs_last_seen") if isinstance(answer.body, dict) else None
    if answer.date is None or not isinstance(seen, (int, float)) or isinstance(seen, bool):
        return None
    return answer.date - float(seen)


def member_started_at(body: Any) -> datetime.datetime | None:
    """The postmaster start time a member's status reports (aware), or None."""
    text = body.get("postmaster_start_time") if isinstance(body, dict) else None
    if not isinstance(text, str):
        return None
    try:
        value = datetime.datetime.fromisoformat(text)
    except ValueError:
        return None
    return value if value.tzinfo is not None else None


def _name(body: Any) -> str | None:
    patroni = body.get("patroni") if isinstance(body, dict) else None
    name = patroni.get("name") if isinstance(patroni, dict) else None
    return name if isinstance(name, str) else None


def _scope(body: Any) -> str | None:
    patroni = body.get("patroni") if isinstance(body, dict) else None
    scope = patroni.get("scope") if isinstance(patroni, dict) else None
    return scope if isinstance(scope, str) else None


#: Why nothing is confirmed during a DCS outage (the docstring's failsafe section).
DCS_OUTAGE = (
    "no lock is confirmed while Patroni cannot reach its DCS, in failsafe mode too "
    "(docs/limits.md, limit 36)"
)
_FAILSAFE = (
    "Patroni cannot reach its DCS and this member leads on in failsafe mode "
    "(failsafe_mode), without the leader key"
)


def judge(
    answer: Answer, server: ServerIdentity, sent_at: float, timing: Timing, margin: float,
    member: str,
) -> Confirmation:  # fmt: skip
    """Turn a member's answer to ``GET /leader`` (sent at ``sent_at``) into a Confirmation.

    ``member`` names the member (host:port) in reasons. Pure: no I/O, no clock.
    """

    def refuse(reason: str, standing: Standing = Standing.CANNOT_TELL) -> Confirmation:
        return Confirmation(
            False, 0.0, f"{reason} (Patroni member at {member})", _name(body), standing
        )

    body = answer.body
    if answer.status == 0:
        return refuse(f"cannot tell: no answer ({answer.error or 'no response'})")
    if not isinstance(body, dict):
        return refuse(f"cannot tell: HTTP {answer.status} without a status in JSON")
    started = member_started_at(body)
    if started is None:
        return refuse("cannot tell: its Postgres is not running or reports no start time")
    if started != server.started_at:
        return refuse(
            "cannot tell: it runs another postmaster than the lock session's server "
            "(restarted, or another member)",
            Standing.ELSEWHERE,
        )
    if answer.status == 503:
        return refuse(
            "not the leader: Patroni says it does not hold the leader key", Standing.NOT_LEADER
        )
    if answer.status != 200:
        return refuse(f"cannot tell: HTTP {answer.status}")
    if body.get("role") != "primary" or body.get("state") != "running":
        return refuse(
            f"not the leader: its Postgres is {body.get('role')!s}, {body.get('state')!s}",
            Standing.NOT_LEADER,
        )
    if body.get("failsafe_mode_is_active"):
        return refuse(f"cannot tell: {_FAILSAFE}; {DCS_OUTAGE}")
    if body.get("cluster_unlocked"):
        return refuse("cannot tell: its view of the DCS has no leader or has expired")
    age = _loop_read_age(answer)
    if age is None:
        return refuse("cannot tell: the answer lacks dcs_last_seen or a Date header")
    if age > timing.stale:
        return refuse(
            f"cannot tell: its HA loop last read the DCS {age:.0f} s ago (a DCS outage, or "
            "a stalled loop)"
        )
    window = timing.window(margin)
    if window <= 0:
        return refuse(
            f"cannot tell: Patroni's ttl {timing.ttl:g} s is too short for its loop_wait "
            f"{timing.loop_wait:g} s and retry_timeout {timing.retry_timeout:g} s"
        )
    return Confirmation(True, sent_at + window, "", _name(body), Standing.LEADER)


class MemberClient:
    """The fence's one HTTP client for a cluster's members: each GET done within ``timeout``.

    Its own request loop (_exchange: no proxy, one deadline for the whole request;
    ``https://`` members through ``tls``, the fence's own TLS context, when given:
    tls.tls_context) and one pool of threads, as many as members, to ask them all at
    once; made again in a forked child, whose copy of the pool has no threads. A member that let a
    request time out is not asked again for ``silent_for`` seconds: what would be asked
    of it meanwhile fails at once, so a paused member costs one timeout, not one per lock.
    """

    def __init__(
        self,
        urls: Sequence[str],
        *,
        timeout: float,
        silent_for: float,
        clock: Callable[[], float],
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self.urls = tuple(urls)
        self.timeout = timeout
        self.silent_for = silent_for
        self._clock = clock
        self._guard = threading.Lock()
        #: member URL -> until when it is not asked (it let a request time out).
        self._silent: dict[str, float] = {}
        self._pool: tuple[int, concurrent.futures.ThreadPoolExecutor] | None = None
        #: The TLS context for ``https://`` members (None: the system's CAs, as urllib's).
        self.tls = tls

    def after_fork_in_child(self) -> None:
        """The parent's threads are not in the child, nor whoever held its mutex."""
        self._guard = threading.Lock()
        self._pool = None

    def until_decided(
        self, ask: Callable[[str], T], decides: Callable[[T], bool]
    ) -> list[tuple[str, T]]:
        """``ask(url)`` of every member at once; the answers as they come, up to the
        first that ``decides`` (the others are not waited for: a silent member does
        not delay the one that runs the server), else all of them."""
        if len(self.urls) == 1:
            return [(self.urls[0], ask(self.urls[0]))]
        with self._guard:
            if self._pool is None or self._pool[0] != os.getpid():
                # A silent member's request keeps its thread for up to ``timeout``: room
                # for a few rounds at once (GET /config, then GET /leader; several first
                # locks), so that no answer queues behind a silent member's.
                pool = concurrent.futures.ThreadPoolExecutor(
                    4 * len(self.urls), thread_name_prefix="pglock-patroni"
                )
                self._pool = (os.getpid(), pool)
            pool = self._pool[1]
        asked = {pool.submit(ask, url): url for url in self.urls}
        answers: list[tuple[str, T]] = []
        for done in concurrent.futures.as_completed(asked):
            answers.append((asked[done], done.result()))
            if decides(answers[-1][1]):
                break
        return answers

    def request(self, member: str, path: str) -> Answer:
        """GET ``path`` of ``member``, unless it let a request time out a moment ago."""
        with self._guard:
            silent_until = self._silent.get(member, 0.0)
        if self._clock() < silent_until:
            return Answer(0, None, None, "timed out a moment ago (not asked again yet)")
        answer = self.get(member + path)
        with self._guard:
            if answer.timed_out:
                self._silent[member] = self._clock() + self.silent_for
            else:
                self._silent.pop(member, None)
        return answer

    def get(self, url: str) -> Answer:
        """GET ``url`` now, within ``timeout`` in all: connecting, TLS, the request, the
        status line, the headers and the body, so that a member trickling its answer
        (each byte within a per-read timeout) ends it as a silent one does."""
        try:
            status, headers, raw = _exchange(url, self.tls, time.monotonic() + self.timeout)
        except (OSError, ValueError, http.client.HTTPException) as exc:
            # A reply cut short or not HTTP at all (IncompleteRead, BadStatusLine) is
            # no answer, like a refused connection: never a confirmation, never raised.
            return Answer(
                0, None, None, _describe(exc), timed_out=_is_timeout(exc), tls=_is_tls(exc)
            )
        date: float | None = None
        if headers.get("Date"):
            try:
                date = email.utils.parsedate_to_datetime(headers["Date"]).timestamp()
            except (TypeError, ValueError):
                date = None
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = None
        return Answer(status, date, body)


#: The most of a member's answer that is read: Patroni's largest (GET /cluster of a big
#: cluster) is a few kB.
LONGEST_ANSWER = 1 << 20


def _left(deadline: float) -> float:
    """The seconds until ``deadline``; TimeoutError once it has passed."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("the request's deadline passed")
    return left


@functools.cache
def _system_tls() -> ssl.SSLContext:
    """What urllib uses for https without a context: the system's CAs, host names checked."""
    return ssl.create_default_context()


class _Received:
    """A whole answer, as http.client's parser reads a socket."""

    def __init__(self, data: bytes) -> None:
        self._data = data

    def makefile(self, mode: str) -> io.BytesIO:
        del mode  # read only
        return io.BytesIO(self._data)


def _exchange(
    url: str, tls: ssl.SSLContext | None, deadline: float
) -> tuple[int, email.message.Message, bytes]:
    """GET ``url`` (no proxy: one from the environment could answer for a member that is
    gone), done by ``deadline`` (time.monotonic()) or TimeoutError.

    Every socket operation is given what is left until the deadline as its timeout,
    which Python applies to the whole call (``create_connection``, ``sendall``, and
    the TLS handshake in ``do_handshake``), and the answer is read by this loop, one
    ``recv`` at a time, up to its Content-Length or the end of the connection. The
    resolution of a host name (getaddrinfo) is the resolver's own, and not bounded here.
    """
    parts = urllib.parse.urlsplit(url)
    host = parts.hostname or ""
    secure = parts.scheme == "https"
    port = parts.port or (443 if secure else 80)
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    with contextlib.ExitStack() as closing:
        sock: socket.socket = closing.enter_context(
            socket.create_connection((host, port), timeout=_left(deadline))
        )
        if secure:
            context = tls if tls is not None else _system_tls()
            sock = closing.enter_context(
                context.wrap_socket(sock, server_hostname=host, do_handshake_on_connect=False)
            )
            sock.settimeout(_left(deadline))
            sock.do_handshake()
        authority = f"[{host}]" if ":" in host else host
        request = (
            f"GET {target} HTTP/1.1\r\nHost: {authority}:{port}\r\n"
            "Accept: application/json\r\nUser-Agent: pglock-celery\r\nConnection: close\r\n\r\n"
        )
        sock.settimeout(_left(deadline))
        sock.sendall(request.encode("idna" if not host.isascii() else "ascii"))
        received = bytearray()
        while not _whole(received):
            sock.settimeout(_left(deadline))
            chunk = sock.recv(65536)
            if not chunk:
                break
            received += chunk
            if len(received) > LONGEST_ANSWER:
                raise ValueError("the answer is too long for a Patroni status")
    response = http.client.HTTPResponse(_Received(bytes(received)))  # type: ignore[arg-type]
    response.begin()
    return response.status, response.msg, response.read()


def _whole(received: bytearray) -> bool:
    """Whether ``received`` holds a whole answer with a Content-Length (else the answer
    ends with the connection, which ``Connection: close`` asks of the member)."""
    end = received.find(b"\r\n\r\n")
    if end < 0:
        return False
    for line in bytes(received[:end]).split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            try:
                return len(received) - end - 4 >= int(value.strip())
            except ValueError:
                return False
    return False


class LeaderFence:
    """Patroni as a leader source (leader.LeaderSource): is a server its cluster's leader?

    Built from ``pglock_patroni_url``; one per source (a configuration), shared by
    threads. :meth:`confirm` reuses a confirmation while it stays valid for the time
    asked, else asks the member that runs the server (``GET /leader``, and ``GET
    /config`` when the timing is older than ``config_max_age``), all members when it
    does not know which one, through its one client (MemberClient).
    """

    name = "the Patroni cluster"

    def __init__(
        self,
        urls: str | Sequence[str],
        *,
        timeout: float = 1.0,
        margin: float = 2.0,
        config_max_age: float = 5.0,
        silent_for: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self.urls = parse_urls(urls if isinstance(urls, str) else list(urls))
        self.timeout = timeout
        self.margin = margin
        self.config_max_age = config_max_age
        self._clock = clock
        self._client = MemberClient(
            self.urls, timeout=timeout, silent_for=silent_for, clock=clock, tls=tls
        )
        self._guard = threading.Lock()
        self._timing: tuple[float, Timing] | None = None
        self._scopes: set[str] = set()
        #: postmaster start time -> the member URL that runs it, as last seen.
        self._where: dict[datetime.datetime, str] = {}
        self._last: dict[datetime.datetime, Confirmation] = {}
        #: Why GET /config failed last, when a DCS outage (_dcs_outage), until it is read.
        self._outage: str | None = None

    @classmethod
    def from_setting(cls, value: str | Sequence[str], config: Any = None) -> LeaderFence:
        """The fence of ``pglock_patroni_url``'s value; with ``config`` (a PglockConfig,
        or any object with its ``patroni_cafile``, ``patroni_certfile`` and
        ``patroni_keyfile``), its members over HTTPS are verified with those files."""
        files = [getattr(config, name, None) for name in TLS_SETTINGS]
        return cls(parse_urls(value), tls=tls_context(*files))

    @staticmethod
    def parse_setting(raw: Any) -> tuple[str, ...]:
        """``pglock_patroni_url``'s value: the members' URLs (parse_urls)."""
        return parse_urls(raw)

    @property
    def longest_ask(self) -> float:
        """The most one confirm() takes: GET /config, GET /leader, and a search."""
        return 3 * self.timeout

    def identify(self, conn: psycopg.Connection[Any]) -> ServerIdentity:
        """The server ``conn`` is on, by its postmaster's start time (what every member's
        status reports)."""
        return server_identity(conn)

    def after_fork_in_child(self) -> None:
        """The child keeps what was learned (confirmations run on the monotonic clock,
        which the child shares), not the parent's mutex or threads."""
        self._guard = threading.Lock()
        self._client.after_fork_in_child()

    def confirm(self, server: ServerIdentity, *, fresh_for: float = 0.0) -> Confirmation:
        """Is ``server`` the leader? Reuses the last answer while valid for ``fresh_for`` s.

        The result may confirm for less than ``fresh_for`` (or not at all): check it with
        ``valid(for_at_least=...)``. A refusal is not kept in place of a confirmation the
        caller still holds: that one stays valid until its ``until``. Each request takes
        at most ``timeout`` in all (MemberClient.get): usually one request (``GET /leader``),
        two when the timing is older than ``config_max_age``; when the member running
        ``server`` is not known yet, all members are asked at once (``GET /config`` too),
        and a failed ``GET /config`` asks ``GET /patroni`` why (a DCS outage).
        """
        with self._guard:
            last = self._last.get(server.started_at)
            url = self._where.get(server.started_at)
        if last is not None and last.valid(self._clock(), for_at_least=fresh_for):
            return last
        timing = self._current_timing(url)
        if isinstance(timing, Confirmation):
            return timing
        if url is not None:
            verdict = self._ask(url, server, timing)
            if verdict.standing is not Standing.ELSEWHERE:
                return self._keep(server, url, verdict)
        return self._search(server, timing)

    def timing(self) -> Timing | None:
        """The last timing read from ``GET /config``, if any."""
        with self._guard:
            return self._timing[1] if self._timing else None

    def read_timing(self) -> Timing | None:
        """The cluster's timing, read now when the last is too old; None when no
        member gives it (each asked once, within ``timeout``)."""
        timing = self._current_timing(None)
        return timing if isinstance(timing, Timing) else None

    def check_interval(self, wanted: float) -> float:
        """The check interval of a lock under this fence: ``wanted``, or less when the
        cluster's window needs it (fenced_check_interval). ``wanted`` while the timing
        is unknown, or when no interval fits (its confirmations are then refused)."""
        timing = self.timing()
        if timing is None:
            return wanted
        fits = fenced_check_interval(
            timing, wanted=wanted, timeout=self.timeout, margin=self.margin
        )
        return wanted if fits is None else fits

    def problem(self, wanted: float) -> str | None:
        """Why no lock can be kept under this fence with the cluster's timing, if so.

        Reads the timing (GET /config); a cluster that does not answer is no
        problem here (every lock fails closed until it does).
        """
        timing = self.read_timing()
        if timing is None:
            return None
        if (
            fenced_check_interval(timing, wanted=wanted, timeout=self.timeout, margin=self.margin)
            is not None
        ):
            return None
        least = shortest_ttl(timing, timeout=self.timeout, margin=self.margin)
        return (
            f"Patroni's ttl {timing.ttl:g} s, loop_wait "
            f"{timing.loop_wait:g} s and retry_timeout {timing.retry_timeout:g} s trust a "
            f"leader's confirmation for {max(timing.window(self.margin), 0):g} s, too short "
            "to keep any lock confirmed between two checks: raise ttl to at least "
            f"{least:g} (patronictl edit-config -s ttl={least:g}), or lower loop_wait"
        )

    def status(self, url: str, path: str) -> Answer:
        """GET ``path`` of the member at ``url`` now, within ``timeout``, for a tool that
        inspects the cluster (the doctor); the fence's own state is left as it is."""
        return self._client.get(url + path)

    # -- internals ---------------------------------------------------------------------

    def _keep(self, server: ServerIdentity, url: str, verdict: Confirmation) -> Confirmation:
        with self._guard:
            self._where[server.started_at] = url
            self._last[server.started_at] = verdict
            if len(self._last) > 64:  # sessions of postmasters long gone
                oldest = next(iter(self._last))
                self._last.pop(oldest, None)
                self._where.pop(oldest, None)
        return verdict

    def _search(self, server: ServerIdentity, timing: Timing) -> Confirmation:
        """Ask every member at once; the first answer from the one running ``server``'s
        postmaster decides, whatever the others do."""
        answers = self._client.until_decided(
            lambda url: self._ask(url, server, timing),
            lambda verdict: verdict.standing in (Standing.LEADER, Standing.NOT_LEADER),
        )
        url, verdict = answers[-1]
        if verdict.standing in (Standing.LEADER, Standing.NOT_LEADER):
            return self._keep(server, url, verdict)
        reasons = [v.reason for _, v in answers if v.standing is not Standing.ELSEWHERE]
        detail = "; ".join(dict.fromkeys(reasons)) if reasons else "none runs it"
        return Confirmation(
            False, 0.0,
            f"cannot tell: no Patroni member answered for the lock session's server "
            f"{server.host}:{server.port} ({detail})",
        )  # fmt: skip

    def _ask(self, url: str, server: ServerIdentity, timing: Timing) -> Confirmation:
        sent_at = self._clock()
        answer = self._client.request(url, "/leader")
        verdict = judge(answer, server, sent_at, timing, self.margin, _shown(url))
        scope = _scope(answer.body)
        with self._guard:
            if scope is not None:
                self._scopes.add(scope)
            mixed = len(self._scopes) > 1
        if mixed:
            return Confirmation(
                False, 0.0,
                "cannot tell: pglock_patroni_url names members of more than one Patroni "
                "cluster (scopes differ)",
            )  # fmt: skip
        return verdict

    def _current_timing(self, url: str | None) -> Timing | Confirmation:
        with self._guard:
            cached = self._timing
        now = self._clock()
        if cached is not None and now - cached[0] < self.config_max_age:
            return cached[1]

        def read(candidate: str) -> tuple[Answer, Timing | str]:
            """The member's answer, and its timing or why there is none."""
            answer = self._client.request(candidate, "/config")
            if answer.status != 200:
                return answer, answer.error if answer.status == 0 else f"HTTP {answer.status}"
            try:
                return answer, Timing.from_config(answer.body)
            except ValueError as exc:
                return answer, str(exc)

        # All at once when the member is not known: during a DCS outage every member's
        # REST thread waits on the DCS, and one after the other would cost a timeout each.
        answers = (
            [(url, read(url))]
            if url
            else self._client.until_decided(read, lambda got: isinstance(got[1], Timing))
        )
        for _, (_, found) in answers:
            if isinstance(found, Timing):
                with self._guard:
                    self._timing = (now, found)
                    self._outage = None
                return found
        problems = [f"{_shown(candidate)}: {found}" for candidate, (_, found) in answers]
        # A member was asked (not only ones that timed out a moment ago).
        asked = any(answer.timed_out or answer.status != 0 for _, (answer, _) in answers)
        unread = "Patroni's dynamic configuration (GET /config) could not be read: " + "; ".join(
            problems
        )
        # A member silenced by its timeout a moment ago is not asked again: what was
        # found then still says why (a paused member costs one diagnosis per silent_for).
        outage = self._dcs_outage(url, cached) if asked else self._outage
        with self._guard:
            self._outage = outage
        return Confirmation(
            False, 0.0, f"cannot tell: {outage}; {DCS_OUTAGE}; {unread}" if outage
            else f"cannot tell: {unread}",
        )  # fmt: skip

    def _dcs_outage(self, url: str | None, cached: tuple[float, Timing] | None) -> str | None:
        """Why ``GET /config`` failed, when it is a DCS outage: Patroni answers it from the
        DCS (its REST thread waits on etcd), ``GET /patroni`` from its own state. Asks the
        member at ``url``, else every member at once (the first that tells decides),
        within ``timeout``."""
        stale = (cached[1] if cached else Timing.from_config({})).stale

        def ask(url: str) -> str | None:
            answer = self._client.get(url + "/patroni")
            if answer.status != 200 or not isinstance(answer.body, dict):
                return None
            age = _loop_read_age(answer)
            read = f"last read the DCS {age:.0f} s ago" if age is not None else "says no more"
            if answer.body.get("failsafe_mode_is_active"):
                return f"{_FAILSAFE} (Patroni member at {_shown(url)}, which {read})"
            if answer.body.get("cluster_unlocked") or age is None or age > stale:
                return f"Patroni cannot read its DCS (its member at {_shown(url)} {read})"
            return None

        if url is not None:
            return ask(url)
        answers = self._client.until_decided(ask, lambda found: found is not None)
        return next((found for _, found in answers if found is not None), None)


def _cause(exc: BaseException) -> BaseException:
    """The error behind urllib's wrapping of it (URLError keeps it as ``reason``)."""
    reason = getattr(exc, "reason", None)
    return reason if isinstance(reason, BaseException) else exc


def _is_timeout(exc: BaseException) -> bool:
    return isinstance(_cause(exc), TimeoutError)


def _is_tls(exc: BaseException) -> bool:
    return isinstance(_cause(exc), ssl.SSLError)


def _describe(exc: BaseException) -> str:
    """Why a request failed, without the URL (urllib quotes it in some messages)."""
    exc = _cause(exc)
    if isinstance(exc, ssl.SSLCertVerificationError):
        return (
            f"TLS: its certificate is not trusted ({exc.verify_message}): "
            "pglock_patroni_cafile must name the CA that signs it"
        )
    if isinstance(exc, ssl.SSLError):
        if "CERTIFICATE_REQUIRED" in str(exc.reason) or "ALERT_BAD_CERTIFICATE" in str(exc.reason):
            return (
                "TLS: it refused this client's certificate (none given, or not one its CA "
                "signs: restapi.verify_client): set pglock_patroni_certfile and "
                "pglock_patroni_keyfile"
            )
        # A member that wants a client certificate may just close the connection (EOF,
        # after the handshake under TLS 1.3) instead of sending its alert first.
        return (
            f"TLS: {tls_reason(exc)}: where restapi.verify_client asks for a client "
            "certificate, set pglock_patroni_certfile and pglock_patroni_keyfile to one "
            "its CA signs"
        )
    if isinstance(exc, TimeoutError):
        return "timed out"
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused"
    return type(exc).__name__
