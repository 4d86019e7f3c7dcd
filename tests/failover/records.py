"""What the failover scenarios' clients recorded, and the overlaps among their holds.

The records are JSON lines written by tests/failover/client.py; times are
CLOCK_MONOTONIC, one clock for every process on the machine.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Hold:
    client: int
    name: str
    grant: float
    port: int
    end: float | None = None
    how: str = "open"


@dataclass
class Records:
    """Everything the clients wrote down."""

    holds: list[Hold] = field(default_factory=list)
    acks: set[tuple[int, str, int, float]] = field(default_factory=set)
    #: When each hold's writes were acknowledged, by (client, grant).
    acked_at: dict[tuple[int, float], list[float]] = field(default_factory=dict)
    failures: list[tuple[int, str, float]] = field(default_factory=list)

    @classmethod
    def read(cls, paths: list[Path], stopped_at: float) -> Records:
        records = cls()
        by_key: dict[tuple[int, float], Hold] = {}
        for path in paths:
            for line in path.read_text().splitlines():
                try:
                    item = json.loads(line)
                except ValueError:
                    continue  # a line cut by the client's end
                if "ack" in item:
                    records.acks.add((item["client"], item["ack"], item["seq"], item["grant"]))
                    key = (item["client"], item["grant"])
                    records.acked_at.setdefault(key, []).append(item["at"])
                elif "hold" in item:
                    known = by_key.get((item["client"], item["grant"]))
                    if known is not None:
                        known.end, known.how = item["end"], item["how"]
                elif "grant" in item:
                    hold = Hold(item["client"], item["grant"], item["at"], item["port"])
                    by_key[(hold.client, hold.grant)] = hold
                    records.holds.append(hold)
                elif "failure" in item:
                    records.failures.append((item["client"], item["failure"], item["at"]))
        for hold in records.holds:
            if hold.end is None:
                hold.end = stopped_at  # it never learned: it held on until stopped
        return records


def overlaps(holds: list[Hold]) -> list[tuple[Hold, Hold]]:
    """Pairs of holds of one name whose intervals intersect."""
    found: list[tuple[Hold, Hold]] = []
    for name in {h.name for h in holds}:
        mine = sorted((h for h in holds if h.name == name), key=lambda h: h.grant)
        for i, first in enumerate(mine):
            for second in mine[i + 1 :]:
                if second.grant >= (first.end or 0):
                    break
                found.append((first, second))
    return found


def after_session_loss(
    first: Hold, second: Hold, records: Records, event: float, port: int, bound: float
) -> bool:
    """Whether ``first`` overlaps ``second`` only because the event ended its session.

    One server never grants a name twice at once. A later hold of a name on the server
    where an earlier one still runs means the server had already ended the earlier
    holder's session: a killed postmaster's surviving backends serve on until they
    notice, and one of them can grant what an exiting backend freed. Nothing can warn
    the earlier holder before that; what is promised is that it learns within the
    detection bound (G11) and that none of its writes commits once its session is gone.
    So such a pair is one on the struck server, begun within the bound of the event,
    whose earlier holder was told (LockLost) within the bound and had no write
    acknowledged after the later grant. Any other overlap is a second holder.
    """
    return (
        first.port == second.port == port
        and event <= second.grant <= event + bound
        and first.how == "lost"
        and first.end is not None
        and first.end - second.grant <= bound
        and all(t <= second.grant for t in records.acked_at.get((first.client, first.grant), []))
    )
