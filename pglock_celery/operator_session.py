"""The short sessions of the operator's tools (the CLI, doctor): never a lock session,
and never waiting for ever on a server that stops answering.

Each has the client-side TCP keepalives and ``tcp_user_timeout`` of a lock session
(so a peer gone from the network is found dead), the connect timeout, and a
client-side deadline on every wait for the server: a statement unanswered within
:data:`OPERATOR_DEADLINE` seconds (a frozen or paused server, whose kernel still
acknowledges every packet, so that no keepalive ever fails) closes the session and
raises :class:`~pglock_celery.handles.StatementDeadline`. No server setting is sent
at startup: a pooler between the tool and the server (which doctor is there to
find) may refuse startup options.
"""

from __future__ import annotations

import math
from collections.abc import Generator
from typing import Any

import psycopg

from .config import PglockConfig
from .dsn import describe_target
from .handles import SessionConnection, StatementDeadline

#: The longest an operator's session waits for one answer of the server, in seconds.
OPERATOR_DEADLINE = 10.0


class OperatorConnection(SessionConnection):
    """A tool's connection: each wait bounded, a statement past its deadline closes it."""

    statement_deadline: float | None = OPERATOR_DEADLINE
    #: What the errors call the server (no password: describe_target).
    target = "the server"

    def wait(
        self,
        gen: Generator[Any, Any, Any],
        interval: float = 0.1,
        timeout: float | None = None,
    ) -> Any:
        try:
            return super().wait(gen, interval, timeout)
        except StatementDeadline as exc:
            # Nothing more can be asked of a server that stopped answering; closed, the
            # session's exit does not try a rollback on it.
            self.close()
            raise StatementDeadline(
                f"{self.target} stopped answering: no answer within {self.statement_deadline:g} s"
            ) from exc


def operator_session(
    dsn: str,
    application_name: str,
    *,
    connect_timeout: float = 5.0,
    autocommit: bool = True,
    config: PglockConfig | None = None,
    **kwargs: Any,
) -> psycopg.Connection[Any]:
    """Open a tool's session to ``dsn``; raises psycopg.Error if it cannot.

    Keepalives and tcp_user_timeout are ``config``'s (default: the defaults); the
    connect takes at most ``connect_timeout`` per address (libpq: whole seconds, at
    least 2), each wait after it at most OPERATOR_DEADLINE.
    """
    config = config or PglockConfig()
    conn = OperatorConnection.connect(
        dsn,
        autocommit=autocommit,
        application_name=application_name,
        connect_timeout=max(2, math.ceil(connect_timeout)),
        keepalives=1,
        keepalives_idle=config.keepalives_idle,
        keepalives_interval=config.keepalives_interval,
        keepalives_count=config.keepalives_count,
        tcp_user_timeout=int(config.tcp_user_timeout * 1000),
        **kwargs,
    )
    conn.target = describe_target(dsn)
    return conn
