"""The scenarios' bookkeeping: holds read from the clients' records, overlaps among them."""

from __future__ import annotations

import json
from pathlib import Path

from tests.failover.records import Hold, Records, overlaps


def write(path: Path, *items: dict[str, object]) -> Path:
    path.write_text("".join(json.dumps(item) + "\n" for item in items) + '{"cut')
    return path


def test_holds_are_read_with_their_ends_and_acks_are_not_taken_for_grants(tmp_path: Path) -> None:
    path = write(
        tmp_path / "c0.jsonl",
        {"grant": "a", "client": 0, "at": 1.0, "port": 5},
        {"ack": "a", "client": 0, "seq": 0, "grant": 1.0, "at": 1.1},
        {"hold": "a", "client": 0, "grant": 1.0, "end": 2.0, "how": "released"},
        {"grant": "b", "client": 0, "at": 3.0, "port": 5},
        {"failure": "LockUnavailable", "client": 0, "at": 3.5},
    )
    records = Records.read([path], stopped_at=9.0)
    assert [(h.name, h.grant, h.end, h.how) for h in records.holds] == [
        ("a", 1.0, 2.0, "released"),
        ("b", 3.0, 9.0, "open"),  # never closed: held until its client was stopped
    ]
    assert records.acks == {(0, "a", 0, 1.0)}
    assert records.failures == [(0, "LockUnavailable", 3.5)]


def test_overlaps_are_pairs_of_holds_of_one_name_that_intersect() -> None:
    holds = [
        Hold(0, "a", 0.0, 1, end=2.0),
        Hold(1, "a", 2.0, 1, end=3.0),  # begins as the first ends: no overlap
        Hold(2, "a", 2.5, 2, end=4.0),  # within the second
        Hold(3, "b", 0.5, 2, end=9.0),  # another name
        Hold(4, "a", 1.0, 2, end=10.0),  # across all of "a"'s others
    ]
    found = {(x.client, y.client) for x, y in overlaps(holds)}
    assert found == {(0, 4), (4, 1), (4, 2), (1, 2)}
