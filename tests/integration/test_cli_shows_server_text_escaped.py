"""The CLI prints text from the server with its control characters escaped.

A lock name (from a lock session's application_name) or a table name may hold a
newline that would forge a row of the output, or an escape sequence that would reach
the operator's terminal: in the tables and lines every such character is shown
escaped, and the JSON, still exact, carries none raw either.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import psycopg
import pytest
from psycopg import sql

from pglock_celery import try_lock
from tests.support.cli import cli
from tests.support.services import own_database

#: A line break that forges a row, a clear-screen sequence, a bidirectional override,
#: DEL and a C1 control (CSI): all must arrive escaped.
HOSTILE = "\n[ok]   forged: 1 2 3\x1b[2J\u202e\x7f\x9b"
#: As short a name that carries them (an application_name keeps about 27 bytes of it).
SHORT_HOSTILE = "\nx 1\x1b[2J\u202e\x7f\x9b"
#: What a terminal acts on: every control (C0, DEL, C1) and Unicode's format characters.
RAW = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f\u200b-\u200f\u2028-\u202e\u2066-\u2069]")


def _assert_nothing_raw(text: str) -> None:
    assert not RAW.search(text), f"a raw control character in:\n{text!r}"


@pytest.fixture
def db(pg_dsn: str) -> Iterator[str]:
    with own_database(pg_dsn) as dsn:
        yield dsn


def test_locks_shows_a_hostile_lock_name_escaped_on_its_own_row(db: str, run_id: str) -> None:
    name = f"{run_id}{SHORT_HOSTILE}"
    with try_lock(name, dsn=db) as lock:
        assert lock.acquired
        table = cli("locks", "--prefix", run_id, dsn=db)
        listed = cli("locks", "--json", "--prefix", run_id, dsn=db)
    assert table.returncode == 0, table.stderr
    print("\n" + table.stdout)
    _assert_nothing_raw(table.stdout)
    lines = table.stdout.splitlines()
    assert len(lines) == 3, lines  # the header, the one lock, the count
    assert lines[1].split("  ")[0] == f"{run_id}\\nx 1\\x1b[2J\\u202e\\x7f\\x9b"
    assert lines[2] == "1 advisory lock(s) held"
    assert listed.returncode == 0, listed.stderr
    _assert_nothing_raw(listed.stdout)
    assert [row["name"] for row in json.loads(listed.stdout)] == [name]


def test_guard_list_and_doctor_show_a_hostile_table_name_escaped(db: str) -> None:
    table = f"cli{HOSTILE}"
    with psycopg.connect(db, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE TABLE {} (id int)").format(sql.Identifier(table)))
        quoted = sql.Identifier(table).as_string(conn)
    installed = cli("guard", "install", quoted, "--lock", "row:{id}", dsn=db)
    assert installed.returncode == 0, installed.stderr
    _assert_nothing_raw(installed.stdout)
    listing = cli("guard", "list", dsn=db)
    doctor = cli("doctor", dsn=db)
    listed = cli("guard", "list", "--json", dsn=db)
    print("\n" + listing.stdout + doctor.stdout)
    assert listing.returncode == 0, listing.stderr
    for done in (listing, doctor, listed):
        _assert_nothing_raw(done.stdout + done.stderr)
    rows = listing.stdout.splitlines()
    assert len(rows) == 3, rows  # the header, the table, the count
    assert "cli\\n[ok]   forged: 1 2 3\\x1b[2J\\u202e\\x7f\\x9b  row:{id}  on" in rows[1]
    guarded = [line for line in doctor.stdout.splitlines() if "forged" in line]
    assert len(guarded) == 1 and guarded[0].startswith("[ok]   guarded table: "), guarded
    assert [row["table"] for row in json.loads(listed.stdout)] == [f"public.{table}"]
