"""Reading the protocol messages a server sent on a lock session (session._messages), and
which of them end the session while a holder's statement is under way."""

from __future__ import annotations

from pglock_celery.session import _ends_the_session, _messages


def message(kind: bytes, body: bytes) -> bytes:
    """A protocol message: its type byte, its length (itself included), its body."""
    return kind + (len(body) + 4).to_bytes(4, "big") + body


def error_fields(**fields: str) -> bytes:
    """An ErrorResponse or NoticeResponse body: one-letter fields, each NUL-ended."""
    return b"".join(key.encode() + value.encode() + b"\0" for key, value in fields.items()) + b"\0"


def kinds(data: bytes) -> list[bytes]:
    return [kind for kind, _ in _messages(data)]


def test_every_whole_message_is_read_in_order() -> None:
    data = message(b"N", b"notice") + message(b"A", b"") + message(b"E", b"SFATAL\x00")
    assert kinds(data) == [b"N", b"A", b"E"]
    assert _messages(data)[0] == (b"N", b"notice")


def test_a_message_cut_short_still_counts_once_its_header_is_there() -> None:
    whole = message(b"N", b"notice")
    assert kinds(whole + message(b"E", b"x" * 100)[:5]) == [b"N", b"E"]


def test_a_header_cut_short_does_not_count() -> None:
    assert kinds(message(b"N", b"n") + b"E\x00\x00\x00") == [b"N"]
    assert kinds(b"") == []


def test_a_long_body_is_skipped_whole() -> None:
    body = b"E" * 300  # an "E" inside a body is not a message
    assert kinds(message(b"N", body) + message(b"Z", b"I")) == [b"N", b"Z"]


def test_a_fatal_error_or_a_57p_code_ends_the_session_among_results() -> None:
    terminated = error_fields(S="FATAL", V="FATAL", C="57P01", M="terminating connection")
    assert _ends_the_session(b"E", terminated)
    assert _ends_the_session(b"E", error_fields(S="PANIC", V="PANIC", C="XX000"))
    crash = error_fields(S="WARNING", V="WARNING", C="57P02", M="crash of another process")
    assert _ends_the_session(b"N", crash)
    # A localized severity without V: S still says it.
    assert _ends_the_session(b"E", error_fields(S="FATAL", C="57P01"))


def test_a_statements_own_error_or_notice_does_not_end_the_session() -> None:
    assert not _ends_the_session(b"E", error_fields(S="ERROR", V="ERROR", C="22012"))
    assert not _ends_the_session(b"N", error_fields(S="NOTICE", V="NOTICE", C="00000"))
    assert not _ends_the_session(b"D", error_fields(V="FATAL", C="57P01"))  # a data row
