"""A stand-in for Patroni members' REST API, for what a real cluster cannot be made to do.

Each :class:`StandIn` is one member: a real HTTP server on loopback, in a thread of the
test, answering ``GET /patroni``, ``/leader``, ``/config`` and ``/cluster`` the way
Patroni 4.1.5's api.py does (a status JSON with ``postmaster_start_time``,
``dcs_last_seen`` and a ``Date`` header; 200 or 503 for ``/leader``; the DCS's dynamic
configuration as stored; the members with their ``api_url``, ``host`` and ``port``).
What it reports is set by the test: a dynamic configuration Patroni itself would not run
with, host names spelled otherwise than the DSN spells them, or an answer trickled one
byte at a time (``trickle``: the pause between bytes, each well within a per-read timeout).

The member running the real local Postgres reports that server's own postmaster start
time (:func:`postmaster_start`), so the library's fence and doctor, which know a server
by it, recognise it as they would behind a real Patroni.
"""

from __future__ import annotations

import datetime
import email.utils
import json
import socket
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import psycopg

#: A dynamic configuration Patroni 4.1.5 runs with as it is (no value raised or lowered).
SOUND = {"ttl": 20, "loop_wait": 2, "retry_timeout": 4}


def postmaster_start(dsn: str) -> datetime.datetime:
    """The start time of the postmaster ``dsn`` reaches, as the server reports it."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT pg_catalog.pg_postmaster_start_time()").fetchone()
    assert row is not None and isinstance(row[0], datetime.datetime)
    return row[0]


class StandIn:
    """One Patroni member's REST API on 127.0.0.1 (see the module docstring).

    ``pg_host``/``pg_port``: where it says its Postgres runs (in ``/cluster``);
    ``api_host``: how ``/cluster`` spells its own REST API's host (``api_url``);
    ``trickle``: seconds between the bytes of each answer, None to answer at once;
    ``trickle_for``: the most one trickled answer lasts before it is cut (so that a
    client without a total deadline ends too, after that long).
    """

    def __init__(
        self,
        name: str,
        started_at: datetime.datetime,
        *,
        role: str = "primary",
        pg_host: str = "127.0.0.1",
        pg_port: int = 5432,
        api_host: str = "127.0.0.1",
        config: dict[str, Any] | None = None,
        scope: str = "standin",
        trickle: float | None = None,
        trickle_for: float = 20.0,
    ) -> None:
        self.name = name
        self.started_at = started_at
        self.role = role
        self.pg_host = pg_host
        self.pg_port = pg_port
        self.api_host = api_host
        self.config = dict(SOUND if config is None else config)
        self.scope = scope
        self.trickle = trickle
        self.trickle_for = trickle_for
        #: The cluster's members as ``/cluster`` lists them (set by :func:`cluster`).
        self.members: list[StandIn] = [self]
        #: The paths asked, in order.
        self.requests: list[str] = []
        self._closing = threading.Event()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self.port = int(self._server.server_address[1])
        self._thread = threading.Thread(
            target=self._server.serve_forever, args=(0.05,), daemon=True
        )
        self._thread.start()

    def url(self, host: str = "127.0.0.1") -> str:
        """Its REST API's URL, with the host spelled ``host``."""
        return f"http://{host}:{self.port}"

    def status(self) -> dict[str, Any]:
        """What ``GET /patroni`` reports (Patroni's api.py ``get_postgresql_status``)."""
        return {
            "state": "running",
            "postmaster_start_time": str(self.started_at),
            "role": self.role,
            "timeline": 1,
            "dcs_last_seen": int(time.time()),
            "patroni": {"version": "4.1.5", "scope": self.scope, "name": self.name},
        }

    def member_entry(self) -> dict[str, Any]:
        """This member as ``GET /cluster`` lists it (Patroni's ``cluster_as_json``)."""
        return {
            "name": self.name,
            "role": "leader" if self.role == "primary" else "replica",
            "state": "running" if self.role == "primary" else "streaming",
            "api_url": f"http://{self.api_host}:{self.port}/patroni",
            "host": self.pg_host,
            "port": self.pg_port,
            "timeline": 1,
        }

    def answer(self, path: str) -> tuple[int, dict[str, Any]]:
        if path in ("/patroni", "/"):
            return 200, self.status()
        if path == "/leader":
            return (200 if self.role == "primary" else 503), self.status()
        if path == "/config":
            return 200, self.config
        if path == "/cluster":
            return 200, {"members": [m.member_entry() for m in self.members], "scope": self.scope}
        return 404, {}

    def close(self) -> None:
        self._closing.set()
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        member = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.0"

            def do_GET(self) -> None:
                member.requests.append(self.path)
                status, body = member.answer(self.path)
                if member.trickle is None:
                    payload = json.dumps(body).encode()
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)
                    return
                self._trickle(status, body)

            def _trickle(self, status: int, body: dict[str, Any]) -> None:
                """The whole answer, one byte per ``trickle`` seconds, cut off after
                ``trickle_for`` (or when the stand-in closes)."""
                payload = json.dumps(body).encode()
                whole = (
                    f"HTTP/1.0 {status} OK\r\n"
                    f"Date: {email.utils.formatdate(usegmt=True)}\r\n"
                    "Content-Type: application/json\r\n"
                    f"Content-Length: {len(payload)}\r\n\r\n"
                ).encode() + payload
                ends = time.monotonic() + member.trickle_for
                assert member.trickle is not None
                for byte in whole:
                    # The pace of the trickle is the behaviour under test, not a wait
                    # for something else: the event only ends it early at close().
                    if member._closing.wait(member.trickle) or time.monotonic() > ends:
                        break
                    try:
                        self.connection.sendall(bytes([byte]))
                    except OSError:
                        break
                self.close_connection = True
                try:
                    self.connection.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

            def log_message(self, *args: Any) -> None:
                pass

        return Handler


@contextmanager
def cluster(started_at: Sequence[datetime.datetime], **options: Any) -> Iterator[list[StandIn]]:
    """Members m0 (the leader, the first start time), m1, ... sharing one ``/cluster``
    list and ``options`` (StandIn's keywords); closed at the end."""
    members: list[StandIn] = []
    try:
        for position, start in enumerate(started_at):
            members.append(
                StandIn(
                    f"m{position}",
                    start,
                    role="primary" if position == 0 else "replica",
                    pg_port=5432 if position == 0 else 5432 + position,
                    **options,
                )
            )
        for member in members:
            member.members = members
        yield members
    finally:
        for member in members:
            member.close()
