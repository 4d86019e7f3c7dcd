"""A DSN is shown only through what parsed cleanly, and never its password."""

from __future__ import annotations

from urllib.parse import quote

import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from pglock_celery.config import PglockConfig
from pglock_celery.dsn import (
    MALFORMED,
    describe_target,
    dsn_problem,
    parse_dsn,
    redact,
    without_server,
)
from pglock_celery.probe import pinned_dsn

#: The DSN of the finding: a URI password with an unencoded '/'. libpq reads it as host
#: "postgres", port "Pw9x" and database "7Zq@127.0.0.1:1/db".
SLASHED = "postgresql://postgres:Pw9x/7Zq@127.0.0.1:1/db"
SLASHED_PIECES = ("Pw9x", "7Zq")

#: Passwords with every character that a DSN gives a meaning to.
AWKWARD = [
    "p@ss:w0rd",
    "100%-sure",
    "pass word  two",
    'it\'s "quoted"',
    "back\\slash'@: %20/?#&=",
]


def test_the_findings_uri_is_malformed_and_says_how_to_write_it() -> None:
    problem = dsn_problem(SLASHED)
    assert problem is not None and "%2F" in problem
    assert describe_target(SLASHED) == MALFORMED
    for piece in SLASHED_PIECES:
        assert piece not in problem


def test_libpqs_text_about_a_malformed_dsn_is_dropped_whole() -> None:
    # What libpq says when it tries the mis-parsed URI.
    libpq = 'invalid integer value "Pw9x" for connection option "port"'
    shown = redact(libpq, SLASHED)
    for piece in SLASHED_PIECES:
        assert piece not in shown
    assert "does not parse cleanly" in shown


@pytest.mark.parametrize(
    "dsn",
    [
        "postgresql://u:a@b@h/db",  # an unencoded '@': libpq's host is "b@h"
        "postgresql://u:1234/word@h/db",  # a '/' after digits: a valid port, '@' in dbname
        "postgresql://u:a/b?host=d@h/db",  # a '/' and a query: libpq's host is "d@h/db"
        "postgresql://u:p@h:12x/db",  # a port that is not a number
    ],
)
def test_uris_that_libpq_mis_splits_are_malformed(dsn: str) -> None:
    assert dsn_problem(dsn) is not None
    assert describe_target(dsn) == MALFORMED
    assert parse_dsn(dsn).params == {}


@pytest.mark.parametrize(
    ("dsn", "secret", "reason"),
    [
        ("host=h password=hunter2 oops", "oops", 'a word without "="'),
        ("host=h password='hunter2", "hunter2", "never closed"),
        ("postgresql://u:hun%zz@h/db", "hun%zz", '"%"'),
        ("postgresql://u:hunter2@[::1/db", "hunter2", "IPv6"),  # libpq quotes the whole URI
        ("host=h hunter2=x", "hunter2", "unknown parameter"),
    ],
)
def test_a_dsn_libpq_rejects_gets_our_reason_never_its_quote(
    dsn: str, secret: str, reason: str
) -> None:
    problem = dsn_problem(dsn)
    assert problem is not None and reason in problem
    assert secret not in problem
    assert secret not in redact(f'libpq: "{secret}"', dsn)


@pytest.mark.parametrize("password", AWKWARD)
def test_every_form_of_a_key_value_password_is_masked(password: str) -> None:
    dsn = make_conninfo(host="h", port="1", user="app", dbname="db", password=password)
    assert parse_dsn(dsn).params["password"] == password
    assert describe_target(dsn) == "h:1/db as app"
    text = f"a {password} b {quote(password, safe='')} c {quote(password)} d"
    shown = redact(text, dsn)
    assert password not in shown
    assert quote(password, safe="") not in shown
    assert shown.startswith("a *** b *** c")


@pytest.mark.parametrize("password", AWKWARD)
def test_every_form_of_a_percent_encoded_uri_password_is_masked(password: str) -> None:
    dsn = f"postgresql://app:{quote(password, safe='')}@h:1/db"
    assert dsn_problem(dsn) is None
    assert parse_dsn(dsn).params["password"] == password
    shown = redact(f"{password} and {quote(password, safe='')}", dsn)
    assert shown == "*** and ***"


def test_a_password_in_the_uri_query_is_masked_as_written_too() -> None:
    dsn = "postgresql://app@h/db?password=a%2Fb"
    assert redact("a/b a%2Fb", dsn) == "*** ***"


def test_redact_leaves_a_message_alone_without_a_password() -> None:
    assert redact("nothing here", None) == "nothing here"
    assert redact("host h refused", "host=h dbname=x") == "host h refused"


def test_describe_target_uses_the_parsed_fields_only() -> None:
    assert describe_target("postgresql://u:pw@db.example:6543/app") == "db.example:6543/app as u"
    assert describe_target("dbname=x") == "local socket:5432/x"
    assert describe_target("host=h1,h2 port=1 dbname=d") == "h1:1,h2:1/d"
    assert describe_target("postgresql://%2Fvar%2Frun/db") == "/var/run:5432/db"
    assert describe_target("postgresql://[::1]:7/db") == "::1:7/db"


def test_reprs_never_show_the_dsn() -> None:
    dsn = "host=h password=hunter2"
    assert "hunter2" not in repr(parse_dsn(dsn))
    assert "hunter2" not in repr(PglockConfig(dsn=dsn))


@pytest.mark.parametrize(
    ("dsn", "server", "rest"),
    [
        # One port per host: the pair goes, the others stay in their order.
        ("host=a,b,c port=1,2,3 dbname=x target_session_attrs=read-write", ("b", 2),
         {"host": "a,c", "port": "1,3", "target_session_attrs": "read-write"}),
        # One port for every host.
        ("host=a,b port=5 dbname=x", ("a", 5), {"host": "b", "port": "5"}),
        # No port: libpq's 5432.
        ("host=a,b dbname=x", ("b", 5432), {"host": "a"}),
        # A URI, its password kept for the connection (never shown).
        ("postgresql://u:pw@a:1,b:2/db", ("a", 1), {"host": "b", "port": "2", "password": "pw"}),
        # hostaddr beside host: both lists narrowed alike.
        ("host=a,b hostaddr=10.0.0.1,10.0.0.2 port=1", ("b", 1),
         {"host": "a", "hostaddr": "10.0.0.1"}),
    ],
)  # fmt: skip
def test_a_server_is_left_out_of_a_host_list_with_the_rest_in_order(
    dsn: str, server: tuple[str, int], rest: dict[str, str]
) -> None:
    narrowed = without_server(dsn, *server)
    assert narrowed is not None
    params = conninfo_to_dict(narrowed)
    assert {key: params.get(key) for key in rest} == rest
    assert params.get("dbname") == conninfo_to_dict(dsn).get("dbname")


@pytest.mark.parametrize(
    ("dsn", "server"),
    [
        ("host=a dbname=x", ("a", 5432)),  # nobody else
        ("host=a,b dbname=x", ("c", 5432)),  # not in the list
        ("host=a,b port=1,2 dbname=x", ("a", 2)),  # host and port are one server
        ("host=a,b port=1,2,3 dbname=x", ("a", 1)),  # ports do not pair with hosts
        ("postgresql://u:p/w@h/db", ("h", 5432)),  # does not parse cleanly
    ],
)
def test_a_host_list_that_cannot_be_narrowed_gives_none(dsn: str, server: tuple[str, int]) -> None:
    assert without_server(dsn, *server) is None


def test_a_probe_reaches_the_very_address_its_session_reached() -> None:
    pinned = conninfo_to_dict(
        pinned_dsn("host=db1,db2 hostaddr=10.0.0.1,10.0.0.2 port=5432 dbname=x", "db2", 5432,
                   "10.0.0.2")
    )  # fmt: skip
    assert (pinned["host"], pinned["hostaddr"], pinned["port"]) == ("db2", "10.0.0.2", "5432")
    over_socket = conninfo_to_dict(pinned_dsn("host=/run/pg dbname=x", "/run/pg", 5432, ""))
    assert "hostaddr" not in over_socket and over_socket["host"] == "/run/pg"
