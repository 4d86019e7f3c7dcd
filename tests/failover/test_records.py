"""The scenarios' bookkeeping: holds read from the clients' records, overlaps among them."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from tests.failover.records import Hold, Records, after_session_loss, overlaps


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
    assert records.acked_at == {(0, 1.0): [1.1]}
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


# The event at 10.0 on port 5; the detection bound 2.5 s. The earlier holder's session
# ended at the event; a surviving backend granted the name at 10.02; the earlier holder
# learned at 10.13 and its last write was acknowledged at 9.9.
EARLIER = Hold(3, "a", 9.0, 5, end=10.13, how="lost")
LATER = Hold(0, "a", 10.02, 5, end=10.02, how="lost")


def loss_records(*ack_times: float) -> Records:
    return Records(acked_at={(EARLIER.client, EARLIER.grant): list(ack_times)})


def test_an_overlap_begun_at_the_event_on_the_struck_server_its_holder_told_is_a_loss() -> None:
    assert after_session_loss(EARLIER, LATER, loss_records(9.9), 10.0, 5, 2.5)


@pytest.mark.parametrize(
    "earlier, later, acks",
    [
        (EARLIER, dataclasses.replace(LATER, port=6), [9.9]),  # the grant on another server
        # both on a server the event did not strike
        (dataclasses.replace(EARLIER, port=6), dataclasses.replace(LATER, port=6), [9.9]),
        (EARLIER, dataclasses.replace(LATER, grant=9.95), [9.9]),  # granted before the event
        (EARLIER, dataclasses.replace(LATER, grant=12.6), [9.9]),  # granted after the bound
        (dataclasses.replace(EARLIER, how="released"), LATER, [9.9]),  # released, not told
        (dataclasses.replace(EARLIER, how="open", end=30.0), LATER, [9.9]),  # never told
        (dataclasses.replace(EARLIER, end=12.6), LATER, [9.9]),  # told after the bound
        (EARLIER, LATER, [9.9, 10.05]),  # a write acknowledged after the later grant
    ],
    ids=[
        "other-server",
        "not-struck",
        "before-event",
        "after-bound",
        "released",
        "never-told",
        "told-late",
        "write-after-grant",
    ],
)
def test_every_other_overlap_counts_as_a_second_holder(
    earlier: Hold, later: Hold, acks: list[float]
) -> None:
    assert not after_session_loss(earlier, later, loss_records(*acks), 10.0, 5, 2.5)
