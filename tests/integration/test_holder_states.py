"""A holder's life in every state of its session, under every strategy (hypothesis).

Two holders of each of two names in this process, and the server around them:
acquire and release; a statement, a long one, a pipeline left unsynced for a moment,
a COPY, fenced transactions (a write, nested, an error caught, a rollback, an unlock
inside) and the holder's own transaction, all through ``lock.connection``; handles
kept past release and then used to unlock everything; the holder unlocking its own
lock; its backend terminated, or paused for under a second. Under ``shared`` every
request for SQL is refused (PglockError) and changes nothing.

After every step (G1, G5, G7, G10, G11): at most one holder of a name believes it
holds it, and the server agrees; a loss is found within the detection bound, in
whatever state the session is, and handled whole (no statement of the holder's runs
after it, its backend is gone); a fenced transaction on a lost lock fails at once
and writes nothing; ``held()`` is a bool; a release frees the lock at once; nothing
is left on the server after each example.
"""

from __future__ import annotations

import itertools
import os
import signal
import sys
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import psycopg
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from psycopg import errors as pg_errors
from psycopg import pq

from pglock_celery import LockLost, PglockError
from pglock_celery.keys import key_to_lock_fields
from pglock_celery.sources import registry
from tests.support.leftovers import leftovers
from tests.support.locks import DEDICATED, STRATEGIES, free_elsewhere, lock, run_bounded, terminate
from tests.support.services import wait_until

NAMES = ("a", "b")
SLOTS = (0, 1)
CHECK_INTERVAL = 0.2
#: A loss younger than this may still be unknown to its holder (the first check comes
#: within 1.25 intervals, then one more interval, plus a margin).
DETECTION_BOUND = 1.25 * CHECK_INTERVAL + CHECK_INTERVAL + 0.5
#: Seconds after its event by which a loss must have been found, at the latest.
FOUND_WITHIN = 3.0
#: Seconds for an ended or cut session's backend to leave the server.
GONE_WITHIN = 2.0
#: How long a pipeline, a COPY or a transaction stays open: past a check interval.
MOMENT = 0.25
#: Seconds a long statement runs.
LONG = 1.0
#: A fenced transaction on a lost lock fails well within this.
AT_ONCE = 1.0

EXAMPLES = int(os.environ.get("PGLOCK_HOLDER_EXAMPLES", "10"))
STEPS = int(os.environ.get("PGLOCK_HOLDER_STEPS", "30"))


class Entry:
    """One holder of the machine, and what the model knows of its lock."""

    def __init__(self, name: str, slot: int, full_name: str, dsn: str, strategy: str) -> None:
        self.name = name
        self.slot = slot
        self.full_name = full_name
        self.lock = lock(dsn, full_name, strategy=strategy, check_interval=CHECK_INTERVAL)
        self.reset()

    def reset(self) -> None:
        """A new hold (or none): nothing known of it yet."""
        self.backend_pid: int | None = None
        #: How the server lost the lock ("terminated", "unlocked"), whatever the holder knows.
        self.fate: str | None = None
        self.fate_at = 0.0
        #: Whether the server ended the holder's session (a terminate).
        self.dead = False
        #: Unlocked by its own SQL while in its own transaction, and the name taken by
        #: another session before the loss was found: then it is found only once the
        #: session is between statements again, or at release (docs/limits.md, 4).
        self.masked = False
        #: The holder's connection, once it asked for it during this hold.
        self.handle: psycopg.Connection[Any] | None = None
        #: Handles kept on purpose (kind, object): they must all die at release.
        self.kept: list[tuple[str, Any]] = []
        #: Rows written in the holder's own transaction, still open: never committed.
        self.open_marks: list[str] = []
        #: A lock.transaction() nested in the holder's own transaction pinned the key:
        #: held until that transaction ends, whatever the holder unlocks.
        self.pinned = False
        self.loss_checked = False

    def __repr__(self) -> str:
        return f"{self.name}{self.slot}"

    @property
    def believes(self) -> bool:
        """Whether the holder believes it holds its lock."""
        return self.lock.acquired and self.lock.loss is None

    @property
    def due(self) -> bool:
        """Whether the library must have found this holder's loss by now."""
        return (
            self.fate is not None
            and not self.masked
            and time.monotonic() >= self.fate_at + DETECTION_BOUND
        )

    @property
    def on_server(self) -> bool:
        """Whether, by the model, the server holds the lock for this holder."""
        return self.lock.acquired and self.fate is None

    def gone(self, how: str, at: float | None = None) -> None:
        if self.fate is None:
            self.fate, self.fate_at = how, time.monotonic() if at is None else at


class HolderLives(RuleBasedStateMachine):
    dsn: str = ""
    strategy: str = "reuse"
    table: str = ""

    def __init__(self) -> None:
        super().__init__()
        self.prefix = f"holder-states-{uuid.uuid4().hex[:8]}"
        self.admin = psycopg.connect(self.dsn, autocommit=True)
        self.entries = [
            Entry(name, slot, f"{self.prefix}:{name}", self.dsn, self.strategy)
            for name in NAMES
            for slot in SLOTS
        ]
        #: Handles kept past a release: (kind, object, whose).
        self.released: list[tuple[str, Any, str]] = []
        self.releases = 0
        self._marks = itertools.count()

    # -- the model ---------------------------------------------------------------------

    @property
    def dedicated(self) -> bool:
        return self.strategy in DEDICATED

    def _held(self) -> list[Entry]:
        return [e for e in self.entries if e.lock.acquired]

    def _not_held(self) -> list[Entry]:
        return [e for e in self.entries if not e.lock.acquired]

    def _rivals(self, entry: Entry) -> list[Entry]:
        return [e for e in self.entries if e.name == entry.name and e is not entry]

    def _mark(self) -> str:
        return f"{self.prefix}-{next(self._marks)}"

    def _insert(self, conn: Any, mark: str) -> None:
        conn.execute(f"INSERT INTO {self.table} (mark) VALUES (%s)", (mark,))

    def _count(self, mark: str) -> int:
        row = self.admin.execute(
            f"SELECT count(*) FROM {self.table} WHERE mark = %s", (mark,)
        ).fetchone()
        assert row is not None
        return int(row[0])

    def _server_holds(self, entry: Entry) -> bool:
        """Whether the server shows the lock granted to the holder's backend."""
        classid, objid = key_to_lock_fields(entry.lock.key)
        row = self.admin.execute(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted"
            " AND objsubid = 1 AND classid = %s::int8::oid AND objid = %s::int8::oid"
            " AND pid = %s",
            (classid, objid, entry.backend_pid),
        ).fetchone()
        return row is not None and row[0] > 0

    def _who_holds(self, entry: Entry) -> list[Any]:
        classid, objid = key_to_lock_fields(entry.lock.key)
        return self.admin.execute(
            "SELECT l.pid, a.application_name, a.state, a.query FROM pg_locks l"
            " LEFT JOIN pg_stat_activity a USING (pid) WHERE l.locktype = 'advisory'"
            " AND l.objsubid = 1 AND l.classid = %s::int8::oid AND l.objid = %s::int8::oid",
            (classid, objid),
        ).fetchall()

    def _backend_exists(self, pid: int | None) -> bool:
        row = self.admin.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE pid = %s", (pid,)
        ).fetchone()
        return row is not None and row[0] > 0

    def _free(self, entry: Entry) -> bool:
        return free_elsewhere(self.admin, entry.full_name)

    def _found_lost(self, entry: Entry, where: str) -> None:
        """The loss of ``entry``'s lock must be found within FOUND_WITHIN of its event."""
        deadline = entry.fate_at + FOUND_WITHIN
        while entry.lock.loss is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert entry.lock.loss is not None, (
            f"{entry}: its lock was {entry.fate} {time.monotonic() - entry.fate_at:.2f} s ago "
            f"({where}) and the library has not found it lost; the server: "
            f"{self._who_holds(entry)}"
        )

    def _expect_lost(self, entry: Entry, exc: BaseException, what: str) -> None:
        """``what`` failed with ``exc``: fine only once the lock is gone on the server."""
        assert entry.fate is not None or entry.lock.loss is not None, (
            f"{entry}: {what} failed although its lock is held: {exc!r}"
        )

    def _ended(self, pid: int, at: float | None = None) -> None:
        """The server ended backend ``pid``: wait it out; every holder on it lost its lock."""
        wait_until(lambda: not self._backend_exists(pid), GONE_WITHIN, f"backend {pid} to end")
        for other in self.entries:
            if other.lock.acquired and other.backend_pid == pid:
                other.gone("terminated", at)
                other.dead = True

    def _terminate(self, entry: Entry) -> None:
        pid = entry.backend_pid
        assert pid is not None
        terminate(self.dsn, pid)
        self._ended(pid)

    def _take(self, entry: Entry) -> bool:
        """Acquire ``entry``'s lock; the answer must be the model's."""
        if self.dedicated:
            # A lock the server let go is free for another session.
            busy = any(rival.on_server for rival in self._rivals(entry))
        else:
            # A name is claimed in the process until its holder releases.
            busy = any(rival.lock.acquired for rival in self._rivals(entry))
        # A rival that freed its own lock and has not found it out yet is checked by the
        # library with a pin of one statement, which refuses a try for that instant
        # (docs/limits.md, 4): a skip, never a second holder.
        checked = [r for r in self._rivals(entry) if r.fate == "unlocked" and r.lock.loss is None]
        got = entry.lock.acquire()
        assert got is entry.lock.acquired
        if not got and not busy and checked:
            return False
        assert got is not busy, (
            f"{entry}: acquired {got}, but the model says busy {busy}: {self._who_holds(entry)}"
        )
        if got:
            entry.reset()
            entry.backend_pid = entry.lock.backend_pid
            assert entry.backend_pid is not None
            assert self._server_holds(entry)
            for rival in self._rivals(entry):
                if (
                    rival.fate == "unlocked"
                    and rival.lock.loss is None
                    and self._handle_in_transaction(rival)
                ):
                    rival.masked = True
        return got

    def _connection(self, entry: Entry) -> psycopg.Connection[Any] | None:
        """``lock.connection``, or None after checking why it is refused."""
        if not self.dedicated:
            held = entry.believes
            with pytest.raises(PglockError) as refused:
                entry.lock.connection  # noqa: B018
            if held:
                assert not isinstance(refused.value, LockLost), refused.value
                assert "reuse" in str(refused.value), refused.value
            with pytest.raises(PglockError):
                entry.lock.transaction()
            return None
        if entry.lock.loss is not None:
            with pytest.raises(LockLost):
                entry.lock.connection  # noqa: B018
            return None
        try:
            conn = entry.lock.connection
        except LockLost as exc:
            assert entry.lock.loss is not None, f"{entry}: lock.connection refused: {exc}"
            self._expect_lost(entry, exc, "lock.connection")
            return None
        except psycopg.Error as exc:
            pytest.fail(
                f"{entry}: lock.connection raised a bare {type(exc).__name__} ({exc}), "
                f"not LockLost (its lock: {entry.fate}, found lost: {entry.lock.loss})"
            )
        entry.handle = conn
        return conn

    def _in_transaction(self, conn: psycopg.Connection[Any]) -> bool:
        return conn.info.transaction_status != pq.TransactionStatus.IDLE

    def _began_a_transaction(self, entry: Entry) -> None:
        """``entry`` is in a transaction of its own: a lock it freed and another session
        has since taken is now found only once it is between statements (limits, 4)."""
        if (
            entry.fate == "unlocked"
            and entry.lock.loss is None
            and any(rival.on_server for rival in self._rivals(entry))
        ):
            entry.masked = True

    def _handle_in_transaction(self, entry: Entry) -> bool:
        handle = entry.handle
        return handle is not None and not handle.closed and self._in_transaction(handle)

    def _written(self, entry: Entry, mark: str, in_txn: bool, rows: int = 1) -> None:
        """A write under the held lock: committed now, or when its own transaction ends."""
        if in_txn:
            assert self._count(mark) == 0
            entry.open_marks.append(mark)
        else:
            assert self._count(mark) == rows, f"{entry}: {mark} not written"

    def _fenced_refused(self, entry: Entry) -> None:
        """lock.transaction() on a lost lock: LockLost at once, no body, nothing written."""
        in_txn = self._handle_in_transaction(entry)
        mark = self._mark()
        entered = False
        outcome: BaseException | None = None
        start = time.monotonic()
        try:
            with entry.lock.transaction() as tx:
                entered = True
                self._insert(tx, mark)
        except (LockLost, psycopg.Error) as exc:
            outcome = exc
        elapsed = time.monotonic() - start
        state = f"its lock {entry.fate}, found lost: {entry.lock.loss}, own transaction: {in_txn}"
        assert isinstance(outcome, LockLost), (
            f"{entry}: lock.transaction() on a lost lock gave {outcome!r} ({state})"
        )
        assert not entered, f"{entry}: lock.transaction() ran its body on a lost lock ({state})"
        assert elapsed < AT_ONCE, f"{entry}: LockLost only after {elapsed:.2f} s"
        assert self._count(mark) == 0

    # -- the holders -------------------------------------------------------------------

    @initialize()
    def start_holding(self) -> None:
        """No cached session of an earlier example; one holder of each name to start with."""
        registry.close()
        for entry in self.entries:
            if entry.slot == 0:
                assert self._take(entry)

    @precondition(lambda self: bool(self._not_held()))
    @rule(data=st.data())
    def acquire(self, data: st.DataObject) -> None:
        self._take(data.draw(st.sampled_from(self._not_held()), label="holder"))

    @precondition(lambda self: bool(self._held()))
    @rule(data=st.data(), found_first=st.booleans())
    def release(self, data: st.DataObject, found_first: bool) -> None:
        """Release (with ``found_first``, a lost lock once the library found the loss)."""
        entry = data.draw(st.sampled_from(self._held()), label="holder")
        if found_first and entry.fate is not None and not entry.masked:
            self._found_lost(entry, "before its release")
        lost = entry.fate is not None or entry.lock.loss is not None
        if lost:
            with pytest.raises(LockLost):
                entry.lock.release()
        else:
            entry.lock.release()
        self.releases += 1
        assert not entry.lock.acquired and entry.lock.backend_pid is None
        if not any(rival.on_server for rival in self._rivals(entry)):
            # G10: free at once after a release (a cut session's backend ends soon after).
            if lost:
                wait_until(lambda: self._free(entry), GONE_WITHIN, f"{entry} to be free")
            else:
                who = self._who_holds(entry)
                assert self._free(entry), f"{entry}: not free after release: {who}"
        for mark in entry.open_marks:
            assert self._count(mark) == 0, f"{entry}: its open transaction outlived the release"
        whose = repr(entry)
        if entry.handle is not None:
            self.released.append(("connection", entry.handle, whose))
        self.released += [(kind, kept, whose) for kind, kept in entry.kept]
        entry.reset()

    @precondition(lambda self: bool(self._held()))
    @rule(data=st.data())
    def statement(self, data: st.DataObject) -> None:
        """A write and a read through lock.connection."""
        entry = data.draw(st.sampled_from(self._held()), label="holder")
        conn = self._connection(entry)
        if conn is None:
            return
        mark = self._mark()
        in_txn = self._in_transaction(conn)
        try:
            self._insert(conn, mark)
            row = conn.execute("SELECT 1").fetchone()
        except (psycopg.Error, LockLost) as exc:
            self._expect_lost(entry, exc, "a statement")
            return
        assert row == (1,)
        assert not entry.dead, f"{entry}: a statement ran on a terminated session"
        if entry.fate is None:
            self._written(entry, mark, in_txn)

    @precondition(lambda self: bool(self._held()))
    @rule(data=st.data(), meanwhile=st.sampled_from([None, "terminate", "unlock_all"]))
    def long_statement(self, data: st.DataObject, meanwhile: str | None) -> None:
        """A write that runs for a while: a loss meanwhile stops it, and it commits nothing."""
        entry = data.draw(st.sampled_from(self._held()), label="holder")
        conn = self._connection(entry)
        if conn is None:
            return
        lost_before = entry.fate is not None
        if lost_before or (meanwhile == "unlock_all" and entry.pinned):
            meanwhile = None  # nothing more to lose, or nothing an unlock can free
        mark = self._mark()
        in_txn = self._in_transaction(conn)
        unlock = "pg_advisory_unlock_all() AS unlocked, " if meanwhile == "unlock_all" else ""
        pid = entry.backend_pid
        assert pid is not None
        killer = threading.Timer(MOMENT, terminate, (self.dsn, pid))
        if meanwhile == "terminate":
            killer.start()
        start = time.monotonic()
        failed: BaseException | None = None
        try:
            conn.execute(
                f"INSERT INTO {self.table} (mark) SELECT %s FROM {unlock}pg_sleep(%s) AS slept",
                (mark, LONG),
            )
        except (psycopg.Error, LockLost) as exc:
            failed = exc
        finally:
            killer.cancel()
            if meanwhile == "terminate":
                killer.join()
        if meanwhile == "terminate":
            self._ended(pid, at=start + MOMENT)
        elif meanwhile == "unlock_all":
            entry.gone("unlocked", at=start)
            self._found_lost(entry, "in a statement under way")
        if lost_before:
            if entry.dead:
                assert failed is not None and self._count(mark) == 0
            return
        if meanwhile is None:
            assert failed is None, f"{entry}: a long statement failed under a held lock: {failed!r}"
            self._written(entry, mark, in_txn)
            return
        assert failed is not None, f"{entry}: a statement outlived the loss of its lock"
        # Whatever the server was running for the holder when the loss was found ends with it.
        time.sleep(max(0.0, start + LONG + MOMENT - time.monotonic()))
        assert self._count(mark) == 0, (
            f"{entry}: a write under way when the loss ({meanwhile}: {entry.lock.loss}) was "
            "found was committed after it"
        )

    @precondition(lambda self: bool(self._held()))
    @rule(data=st.data(), meanwhile=st.sampled_from([None, "terminate", "unlock_all"]))
    def pipeline(self, data: st.DataObject, meanwhile: str | None) -> None:
        """A pipeline left unsynced for a moment: a loss meanwhile is found all the same."""
        entry = data.draw(st.sampled_from(self._held()), label="holder")
        conn = self._connection(entry)
        if conn is None:
            return
        lost_before = entry.fate is not None
        if lost_before or (meanwhile == "unlock_all" and entry.pinned):
            meanwhile = None
        mark = self._mark()
        in_txn = self._in_transaction(conn)
        failed: BaseException | None = None
        try:
            with conn.pipeline():
                self._insert(conn, mark)
                if meanwhile == "unlock_all":
                    conn.execute("SELECT pg_advisory_unlock_all()")  # sent, runs before Sync
                    wait_until(lambda: not self._server_holds(entry), 1, "the unlock to run")
                    entry.gone("unlocked")
                elif meanwhile == "terminate":
                    self._terminate(entry)
                time.sleep(MOMENT)
                if meanwhile is not None:
                    self._found_lost(entry, "inside a pipeline, unsynced")
        except (psycopg.Error, LockLost) as exc:
            failed = exc
        if lost_before:
            # Not fenced: a write before the loss is found may commit, unless the session died.
            if entry.dead:
                assert failed is not None, f"{entry}: a pipeline on a terminated session succeeded"
                assert self._count(mark) == 0, f"{entry}: a pipeline wrote on a terminated session"
            return
        if meanwhile is not None:
            assert failed is not None, f"{entry}: a cut pipeline ended without an error"
            assert self._count(mark) == 0, f"{entry}: a pipeline wrote after its lock was lost"
            return
        assert failed is None, f"{entry}: the pipeline failed under a held lock: {failed!r}"
        self._written(entry, mark, in_txn)

    @precondition(lambda self: bool(self._held()))
    @rule(data=st.data(), meanwhile=st.sampled_from([None, "terminate"]))
    def copy(self, data: st.DataObject, meanwhile: str | None) -> None:
        """A COPY into the table, open for a moment: a loss meanwhile is found all the same."""
        entry = data.draw(st.sampled_from(self._held()), label="holder")
        conn = self._connection(entry)
        if conn is None:
            return
        lost_before = entry.fate is not None
        if lost_before:
            meanwhile = None
        mark = self._mark()
        in_txn = self._in_transaction(conn)
        failed: BaseException | None = None
        try:
            with conn.cursor() as cursor:
                with cursor.copy(f"COPY {self.table} (mark) FROM STDIN") as copy:
                    copy.write_row((mark,))
                    if meanwhile == "terminate":
                        self._terminate(entry)
                    time.sleep(MOMENT)
                    if meanwhile is not None:
                        self._found_lost(entry, "inside a COPY")
                    copy.write_row((mark,))
        except (psycopg.Error, LockLost) as exc:
            failed = exc
        if entry.dead:
            assert failed is not None, f"{entry}: a COPY on a terminated session succeeded"
            assert self._count(mark) == 0, f"{entry}: a COPY wrote after its lock was lost"
            return
        if lost_before:
            return  # not fenced: it may commit before the loss is found
        assert failed is None, f"{entry}: the COPY failed under a held lock: {failed!r}"
        self._written(entry, mark, in_txn, rows=2)

    @precondition(lambda self: bool(self._held()))
    @rule(
        data=st.data(),
        body=st.sampled_from(
            ["write", "caught_error", "rollback", "raise", "uncaught_error", "unlock_all", "commit"]
        ),
        meanwhile=st.sampled_from([None, None, "terminate", "terminate_first"]),
    )
    def fenced_transaction(self, data: st.DataObject, body: str, meanwhile: str | None) -> None:
        """lock.transaction() with a write (and an error, a rollback, an unlock inside)."""
        entry = data.draw(st.sampled_from(self._held()), label="holder")
        if not self.dedicated:
            self._connection(entry)  # checks both refusals
            return
        if entry.fate is not None or entry.lock.loss is not None:
            self._fenced_refused(entry)
            return
        in_txn = self._handle_in_transaction(entry)
        mark = self._mark()
        outcome: BaseException | None = None
        try:
            with entry.lock.transaction() as tx:
                entry.handle = tx
                if meanwhile == "terminate_first":
                    # Between the transaction's opening and the holder's first statement.
                    self._terminate(entry)
                    time.sleep(MOMENT)
                    self._found_lost(entry, "inside lock.transaction(), before a statement")
                self._insert(tx, mark)
                if meanwhile == "terminate":
                    self._terminate(entry)
                    time.sleep(MOMENT)
                    self._found_lost(entry, "inside lock.transaction()")
                elif body == "caught_error":
                    with pytest.raises(pg_errors.DivisionByZero):
                        with tx.transaction():
                            tx.execute("SELECT 1/0")
                elif body == "rollback":
                    raise psycopg.Rollback()
                elif body == "raise":
                    raise ValueError("the body failed")
                elif body == "uncaught_error":
                    tx.execute("SELECT 1/0")
                elif body == "commit":
                    tx.commit()  # refused: the block commits, once the lock is proven again
                elif body == "unlock_all":
                    tx.execute("SELECT pg_advisory_unlock_all()")
                    # Pinned for the transaction: the holder's own unlock frees nothing.
                    assert not self._free(entry), (
                        f"{entry}: unlocked for everyone inside lock.transaction() "
                        f"(own transaction open: {in_txn})"
                    )
        except (LockLost, ValueError, psycopg.Error) as exc:
            outcome = exc
        if meanwhile is not None:
            assert isinstance(outcome, LockLost), (
                f"{entry}: a fenced transaction whose session was terminated gave {outcome!r}"
            )
            assert self._count(mark) == 0
            return
        expected = {
            "raise": ValueError,
            "uncaught_error": pg_errors.DivisionByZero,
            "commit": psycopg.ProgrammingError,
        }.get(body)
        if expected is None:
            assert outcome is None, f"{entry}: lock.transaction() with {body} gave {outcome!r}"
        else:
            assert isinstance(outcome, expected), f"{entry}: {body} gave {outcome!r}"
        if body in ("write", "caught_error", "unlock_all"):
            self._written(entry, mark, in_txn)
            entry.pinned = entry.pinned or in_txn
        else:
            assert self._count(mark) == 0, f"{entry}: a transaction with {body} was committed"

    @precondition(lambda self: bool(self._held()))
    @rule(data=st.data(), inner=st.sampled_from(["ok", "raise"]))
    def nested_transaction(self, data: st.DataObject, inner: str) -> None:
        """lock.transaction() inside lock.transaction(): a savepoint."""
        entry = data.draw(st.sampled_from(self._held()), label="holder")
        if not self.dedicated:
            self._connection(entry)
            return
        if entry.fate is not None or entry.lock.loss is not None:
            self._fenced_refused(entry)
            return
        in_txn = self._handle_in_transaction(entry)
        outer_mark, inner_mark = self._mark(), self._mark()
        with entry.lock.transaction() as tx:
            entry.handle = tx
            self._insert(tx, outer_mark)
            try:
                with entry.lock.transaction() as nested:
                    assert nested is tx
                    self._insert(nested, inner_mark)
                    if inner == "raise":
                        raise ValueError("the inner block failed")
            except ValueError:
                pass
        self._written(entry, outer_mark, in_txn)
        entry.pinned = entry.pinned or in_txn
        if inner == "ok":
            self._written(entry, inner_mark, in_txn)
        else:
            assert self._count(inner_mark) == 0

    @precondition(lambda self: bool(self._held()))
    @rule(data=st.data(), end=st.sampled_from(["rollback", "caught_error", "left_open"]))
    def own_transaction(self, data: st.DataObject, end: str) -> None:
        """The holder's own transaction through lock.connection: rolled back, or left open."""
        entry = data.draw(st.sampled_from(self._held()), label="holder")
        conn = self._connection(entry)
        if conn is None:
            return
        mark = self._mark()
        try:
            if not self._in_transaction(conn):
                conn.execute("BEGIN")
                self._began_a_transaction(entry)
            self._insert(conn, mark)
            if end == "caught_error":
                with pytest.raises(pg_errors.DivisionByZero):
                    conn.execute("SELECT 1/0")
            if end != "left_open":
                conn.execute("ROLLBACK")
        except (psycopg.Error, LockLost) as exc:
            self._expect_lost(entry, exc, f"the holder's own transaction ({end})")
            return
        if end == "left_open":
            entry.open_marks.append(mark)
        else:
            entry.open_marks.clear()  # rolled back with it
            entry.pinned = False
            if entry.masked:  # between statements again: now it is found
                entry.masked, entry.fate_at = False, time.monotonic()
        assert self._count(mark) == 0

    @precondition(lambda self: bool(self._held()))
    @rule(
        data=st.data(),
        in_own_transaction=st.booleans(),
        rival=st.booleans(),
        then=st.sampled_from([None, "transaction", "found"]),
    )
    def unlock_own_lock(
        self, data: st.DataObject, in_own_transaction: bool, rival: bool, then: str | None
    ) -> None:
        """The holder frees its own lock (pg_advisory_unlock_all()): a loss to be found.

        Inside a transaction of its own (left open), or not; then another holder of the
        name may take it at once; then a fenced transaction before the loss can have
        been found, or a wait until it is.
        """
        entry = data.draw(st.sampled_from(self._held()), label="holder")
        conn = self._connection(entry)
        if conn is None:
            return
        try:
            if in_own_transaction and not self._in_transaction(conn):
                conn.execute("BEGIN")
                self._began_a_transaction(entry)
            conn.execute("SELECT pg_advisory_unlock_all()")
        except (psycopg.Error, LockLost) as exc:
            self._expect_lost(entry, exc, "pg_advisory_unlock_all()")
            return
        assert not entry.dead
        if entry.pinned:
            # The pin lasts as long as the transaction: the lock is held until it ends.
            assert self._server_holds(entry), f"{entry}: unlocked through its transaction's pin"
            try:
                conn.execute("ROLLBACK")
            except (psycopg.Error, LockLost) as exc:
                self._expect_lost(entry, exc, "the rollback after pg_advisory_unlock_all()")
                return
            entry.open_marks.clear()
            entry.pinned = False
        assert not self._server_holds(entry), f"{entry}: held after pg_advisory_unlock_all()"
        entry.gone("unlocked")
        if rival:
            for other in self._rivals(entry):
                if not other.lock.acquired:
                    self._take(other)  # refused only for the instant of a check (_take)
                    break
        if then == "transaction":
            self._fenced_refused(entry)
        elif then == "found" and not entry.masked:
            self._found_lost(entry, "after it unlocked its own lock")

    @precondition(lambda self: bool(self._held()))
    @rule(data=st.data(), kind=st.sampled_from(["connection", "cursor", "pgconn", "closed"]))
    def keep_a_handle(self, data: st.DataObject, kind: str) -> None:
        """Keep the connection, a cursor or its pgconn past release; or close the connection."""
        entry = data.draw(st.sampled_from(self._held()), label="holder")
        conn = self._connection(entry)
        if conn is None:
            return
        if kind == "connection":
            entry.kept.append((kind, conn))
        elif kind == "cursor":
            entry.kept.append((kind, conn.cursor()))
        elif kind == "pgconn":
            entry.kept.append((kind, conn.info.pgconn))
        else:
            conn.close()  # revokes this handle only: the lock stays (invariants)
            entry.open_marks.clear()  # its transaction ended with it
            entry.pinned = False
            with pytest.raises(psycopg.Error):
                conn.execute("SELECT 1")
            entry.handle = None

    @precondition(lambda self: self.releases > 0)
    @rule(which=st.integers(0, 7))
    def unlock_all_through_a_kept_handle(self, which: int) -> None:
        """A handle kept past release runs nothing: no pg_advisory_unlock_all() for anyone."""
        if not self.released:
            return  # (whether a handle was kept may depend on timing: the draw does not)
        kind, kept, whose = self.released.pop(which % len(self.released))
        statement = "SELECT pg_advisory_unlock_all()"
        if kind == "pgconn":
            finished, result = run_bounded(lambda: kept.exec_(statement.encode()), 3)
            assert finished, f"{whose}: a kept pgconn hung"
            if not isinstance(result, psycopg.Error):
                assert result.status not in (pq.ExecStatus.TUPLES_OK, pq.ExecStatus.COMMAND_OK), (
                    f"{whose}: a pgconn kept past release ran {statement}"
                )
        else:
            finished, result = run_bounded(lambda: kept.execute(statement), 3)
            assert finished, f"{whose}: a kept {kind} hung"
            assert isinstance(result, psycopg.Error), (
                f"{whose}: a {kind} kept past release ran {statement}: {result!r}"
            )

    @precondition(lambda self: bool(self._held()))
    @rule(data=st.data(), how=st.sampled_from(["held", "ensure_held"]))
    def ask(self, data: st.DataObject, how: str) -> None:
        """held() is a bool, never raises, and a loss it finds is recorded before False."""
        entry = data.draw(st.sampled_from(self.entries), label="holder")
        acquired = entry.lock.acquired
        if how == "held":
            answer = entry.lock.held()
            assert type(answer) is bool
        else:
            try:
                entry.lock.ensure_held()
                answer = True
            except LockLost:
                answer = False
        if not acquired:
            assert answer is False
        elif entry.fate is not None:
            if not entry.masked:
                assert answer is False, f"{entry}: {how} says held, but its lock was {entry.fate}"
            if answer is False:
                assert entry.lock.loss is not None, f"{entry}: {how} found a loss, unrecorded"
        else:
            assert answer is True, f"{entry}: {how} says not held ({entry.lock.loss})"

    @precondition(lambda self: any(e.fate is not None for e in self._held()))
    @rule()
    def time_passes(self) -> None:
        """Let the detection bound pass for a lock the server lost (the invariants judge)."""
        pending = [e.fate_at for e in self._held() if e.fate is not None and not e.masked]
        if pending:
            time.sleep(max(0.0, min(pending) + DETECTION_BOUND - time.monotonic()))

    # -- the server's side -------------------------------------------------------------

    @precondition(lambda self: bool(self._held()))
    @rule(data=st.data())
    def terminate_a_backend(self, data: st.DataObject) -> None:
        entry = data.draw(st.sampled_from(self._held()), label="holder")
        if entry.lock.loss is None and not entry.dead:  # else already cut, or gone
            self._terminate(entry)

    @precondition(lambda self: bool(self._held()))
    @rule(
        data=st.data(),
        seconds=st.sampled_from([0.1, 0.3, 0.8]),
        during=st.sampled_from([None, "statement"]),
    )
    def pause_a_backend(self, data: st.DataObject, seconds: float, during: str | None) -> None:
        """SIGSTOP, then SIGCONT under a second later (mid-statement too): no loss, no harm."""
        entry = data.draw(st.sampled_from(self._held()), label="holder")
        if entry.lock.loss is not None or entry.fate is not None or entry.backend_pid is None:
            return
        conn = self._connection(entry) if during == "statement" else None
        pid = entry.backend_pid
        finished: list[BaseException | None] = []

        def run() -> None:
            assert conn is not None
            try:
                conn.execute("SELECT pg_sleep(0.1)")
                finished.append(None)
            except BaseException as exc:
                finished.append(exc)

        runner = threading.Thread(target=run, daemon=True)
        if conn is not None:
            runner.start()
            time.sleep(0.05)
        os.kill(pid, signal.SIGSTOP)
        try:
            time.sleep(seconds)
        finally:
            os.kill(pid, signal.SIGCONT)
        if conn is not None:
            runner.join(5)
            assert finished == [None], f"{entry}: a statement across a pause failed: {finished}"

    @precondition(lambda self: self.releases > 0)
    @rule()
    def terminate_idle_sessions(self) -> None:
        """End this process's lock sessions that hold nothing (cached, quiet shared ones)."""
        rows = self.admin.execute(
            "SELECT pid FROM pg_stat_activity a WHERE datname = current_database()"
            " AND (application_name = %s OR (application_name LIKE %s AND NOT EXISTS"
            " (SELECT FROM pg_locks l WHERE l.pid = a.pid AND l.locktype = 'advisory')))",
            (f"pglock-idle|{os.getpid()}", f"pglock-shared|{os.getpid()}|%"),
        ).fetchall()
        for (pid,) in rows:
            terminate(self.dsn, pid)
        for (pid,) in rows:
            wait_until(lambda pid=pid: not self._backend_exists(pid), GONE_WITHIN, "idle to end")

    # -- the guarantees ----------------------------------------------------------------

    @invariant()
    def losses_are_found_and_true(self) -> None:
        """A lock the server lost is found lost within the bound; no other loss is reported."""
        for entry in self.entries:
            if not entry.lock.acquired:
                continue
            loss = entry.lock.loss
            if loss is not None:
                assert entry.fate is not None, f"{entry}: found lost, but it was not: {loss}"
            elif entry.due:
                self._found_lost(entry, "after the detection bound")

    @invariant()
    def at_most_one_holder_believes(self) -> None:
        """G1 in the process, and on the server for every holder that believes."""
        for name in NAMES:
            believers = [e for e in self.entries if e.name == name and e.believes]
            settled = [e for e in believers if e.fate is None or e.due]
            assert len([e for e in settled if e.fate is None]) <= 1, f"{name}: {believers}"
            for entry in settled:
                if entry.fate is not None:
                    self._found_lost(entry, "while it still believed it held the lock")
                    continue
                assert self._server_holds(entry), (
                    f"{entry} believes it holds its lock, the server does not: "
                    f"{self._who_holds(entry)}"
                )
                assert not self._free(entry), f"{entry}: another session could take its lock"

    @invariant()
    def a_lost_holder_runs_nothing(self) -> None:
        """After a loss is found: no statement of the holder's, and its backend is gone."""
        for entry in self.entries:
            loss = entry.lock.loss
            if not entry.lock.acquired or loss is None or entry.loss_checked:
                continue
            entry.loss_checked = True
            with pytest.raises(LockLost):
                entry.lock.connection  # noqa: B018
            with pytest.raises(LockLost):
                entry.lock.transaction()
            kept: list[tuple[str, Any]] = list(entry.kept)
            if entry.handle is not None:
                kept.append(("connection", entry.handle))
            for kind, handle in kept:
                mark = self._mark()
                if kind == "pgconn":
                    text = f"INSERT INTO {self.table} (mark) VALUES ('{mark}')".encode()
                    run: Callable[[], Any] = lambda h=handle, t=text: h.exec_(t)  # noqa: E731
                else:
                    run = lambda h=handle, m=mark: self._insert(h, m)  # noqa: E731
                finished, result = run_bounded(run, 3)
                assert finished, f"{entry}: a statement through a lost holder's {kind} hung"
                if kind != "pgconn":
                    assert isinstance(result, psycopg.Error), (
                        f"{entry}: a {kind} of a lost holder ran a statement ({loss})"
                    )
                assert self._count(mark) == 0, f"{entry}: a lost holder's {kind} wrote ({loss})"
            if self.dedicated or loss.takes_the_session:
                pid = entry.backend_pid
                wait_until(
                    lambda pid=pid: not self._backend_exists(pid),
                    GONE_WITHIN,
                    f"{entry}'s backend {pid} to end after its loss ({loss})",
                )

    def teardown(self) -> None:
        """Release everything and find nothing left; after a failed step, only clean up."""
        failing = sys.exc_info()[1] is not None
        problems: list[str] = []
        try:
            if not failing:
                try:
                    for entry in self.entries:
                        if entry.lock.acquired and entry.fate is not None and not entry.masked:
                            self._found_lost(entry, "at the end")
                    self.a_lost_holder_runs_nothing()
                except AssertionError as exc:
                    problems.append(str(exc))
            for entry in self.entries:
                lost = entry.lock.acquired and (
                    entry.fate is not None or entry.lock.loss is not None
                )
                try:
                    entry.lock.release()  # a refused try's session goes too
                except LockLost as exc:
                    if not lost:
                        problems.append(f"{entry}: LockLost at release of a held lock: {exc}")
                except Exception as exc:
                    problems.append(f"{entry}: release failed: {exc!r}")
                else:
                    if lost:
                        problems.append(f"{entry}: released a lost lock without LockLost")
            registry.close()
            if not failing:
                for entry in self.entries:
                    if not _settles(lambda e=entry: self._free(e), GONE_WITHIN):
                        problems.append(f"{entry}: still held at the end: {self._who_holds(entry)}")
                if not _settles(lambda: leftovers(self.dsn) == (0, 0), 5):
                    problems.append(f"left on the server after the example: {self._left()}")
        finally:
            self._scrub()
            self.admin.close()
        assert failing or not problems, "; ".join(problems)

    def _left(self) -> list[Any]:
        return self.admin.execute(
            "SELECT a.pid, a.application_name, a.state, a.query,"
            " (SELECT count(*) FROM pg_locks l WHERE l.pid = a.pid AND l.locktype = 'advisory')"
            " FROM pg_stat_activity a WHERE a.datname = current_database()"
            " AND a.pid <> pg_backend_pid() AND a.application_name LIKE 'pglock%%'"
        ).fetchall()

    def _scrub(self) -> None:
        """End what a failed example left (sessions named for its locks), for the next one."""
        rows = self.admin.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database()"
            " AND application_name LIKE %s",
            (f"%{self.prefix}%",),
        ).fetchall()
        for (pid,) in rows:
            terminate(self.dsn, pid)
        _settles(lambda: not any(self._backend_exists(pid) for (pid,) in rows), GONE_WITHIN)


def _settles(predicate: Callable[[], bool], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


SETTINGS = settings(
    max_examples=EXAMPLES,
    stateful_step_count=STEPS,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    print_blob=True,
    report_multiple_bugs=False,
)


@pytest.mark.usefixtures("empty_cache")
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_holder_keeps_the_guarantees_in_every_state(pg_dsn: str, strategy: str) -> None:
    """G1, G5, G7, G10, G11 after every step of random holders' lives, under ``strategy``."""
    table = f"holder_states_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(f"CREATE TABLE {table} (mark text)")
    machine = type(
        f"HolderLives_{strategy}",
        (HolderLives,),
        {"dsn": pg_dsn, "strategy": strategy, "table": table},
    )
    # Under shared most requests are refusals, which cost little: explore it further.
    examples = EXAMPLES * (2 if strategy == "shared" else 1)
    try:
        run_state_machine_as_test(machine, settings=settings(SETTINGS, max_examples=examples))
    finally:
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute("SET lock_timeout = '10s'")
            conn.execute(f"DROP TABLE {table}")
