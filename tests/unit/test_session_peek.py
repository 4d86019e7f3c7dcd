"""Reading the types of the protocol messages a server sent unasked (session._message_types)."""

from __future__ import annotations

from pglock_celery.session import _message_types


def message(kind: bytes, body: bytes) -> bytes:
    """A protocol message: its type byte, its length (itself included), its body."""
    return kind + (len(body) + 4).to_bytes(4, "big") + body


def test_every_whole_message_is_read_in_order() -> None:
    data = message(b"N", b"notice") + message(b"A", b"") + message(b"E", b"SFATAL\x00")
    assert _message_types(data) == [b"N", b"A", b"E"]


def test_a_message_cut_short_still_counts_once_its_header_is_there() -> None:
    whole = message(b"N", b"notice")
    assert _message_types(whole + message(b"E", b"x" * 100)[:5]) == [b"N", b"E"]


def test_a_header_cut_short_does_not_count() -> None:
    assert _message_types(message(b"N", b"n") + b"E\x00\x00\x00") == [b"N"]
    assert _message_types(b"") == []


def test_a_long_body_is_skipped_whole() -> None:
    body = b"E" * 300  # an "E" inside a body is not a message
    assert _message_types(message(b"N", body) + message(b"Z", b"I")) == [b"N", b"Z"]
