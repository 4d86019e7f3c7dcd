"""A task body's ORM writes fenced by its lock (``pglock_database``).

For the body's length, ``connections[alias]`` in the body's context is a
DatabaseWrapper of the alias's own backend class whose psycopg connection is the
lock's own handle (``lock.connection``). Every ORM statement to that database then
runs on the lock session, and every one is inside ``lock.transaction()``: a
transaction Django begins (``atomic()``, or autocommit turned off) is one from its
first statement to its COMMIT, and a statement in autocommit is one of its own. So
a write commits only if the lock is proven at the transaction's start and again
before its COMMIT; after a loss the session is cut, and nothing more commits.

Which wrapper a call gets is decided by the library's own context variable
(``_bodys_wrapper``), which only the fence sets and resets, and which asyncio and
asgiref carry into every thread they run the body's code in (``asyncio.run``,
``sync_to_async`` either way, ``async_to_sync``): Django's ``connections`` storage
asks it first (``_BodysConnections``). Neither the thread an ORM call lands in nor
what another call of the process installed in its own thread decides. A thread
that carries no body's context keeps the project's connections; one body's wrapper
serves one of its threads at a time (``FencedWrapper._take_turn``), and another's
call meanwhile is refused, never sent through another connection.

Django's own code configures the connection (its cursor class, its adapters and
time zone, ``assume_role``): only where the connection comes from and how a
transaction begins and ends are replaced. The thread's own wrapper is never touched:
Celery's Django fixup closes connections before and after a task, outside this, and
never sees the lock's.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

import psycopg
from django.db import DatabaseError, connections  # type: ignore[import-untyped]
from django.db.backends.postgresql.psycopg_any import (  # type: ignore[import-untyped]
    IsolationLevel,
)
from django.db.backends.utils import debug_transaction  # type: ignore[import-untyped]
from psycopg import pq
from psycopg.adapt import AdaptersMap

from ..exceptions import LockLost, PglockError
from ..lock import _caller
from ..shield import library_code

if TYPE_CHECKING:
    from ..lock import AdvisoryLock

#: The fenced wrapper of the body whose context this is (None outside bodies).
_bodys_wrapper: ContextVar[FencedWrapper | None] = ContextVar("pglock_fenced_orm", default=None)
_install = threading.Lock()


class _RolledBack(Exception):
    """Thrown into a fenced transaction to end it with a rollback."""


@contextlib.contextmanager
def fenced_orm(lock: AdvisoryLock, alias: str) -> Iterator[None]:
    """While the body runs: ``connections[alias]`` is the lock's session, its commits fenced.

    Refused (PglockError) when this thread is already inside ``atomic()`` on that
    alias (an eager call made in a transaction): the body's writes could not join
    that transaction under the lock, and would wait on its row locks.
    """
    _route_connections()
    original = connections[alias]
    if original.in_atomic_block:
        raise PglockError(
            f"lock {lock.label}: the task body would run inside transaction.atomic() on the "
            f"database {alias!r} (pglock_database), whose writes the lock cannot fence: call "
            "the task outside the transaction, e.g. transaction.on_commit(lambda: "
            "task.delay(...))"
        )
    # A task called by another's body: its lock fences its own body, on its own session.
    backend: type = getattr(original, "pglock_backend", type(original))
    wrapper = fenced_class(backend)(_settings_for_the_body(original.settings_dict), alias)
    wrapper.pglock_lock = lock
    token = _bodys_wrapper.set(wrapper)
    try:
        yield
    finally:
        _bodys_wrapper.reset(token)
        with contextlib.suppress(DatabaseError, PglockError):
            wrapper.close()  # rolls back what is still open; the release revokes the handle


class _BodysConnections:
    """Django's ``connections`` storage, asked first for the wrapper of the body whose
    context the caller runs in; every other alias, and every caller outside a body,
    gets what the thread's own storage holds (the project's connections).

    A context copied from the body after its end (a thread it left running) still
    finds the body's wrapper, whose lock is released: its statements fail, never go
    through the project's connection.
    """

    __slots__ = ("_own",)

    def __init__(self, own: Any) -> None:
        object.__setattr__(self, "_own", own)

    def __getattr__(self, alias: str) -> Any:
        wrapper = _bodys_wrapper.get()
        if wrapper is not None and wrapper.alias == alias:
            return wrapper
        return getattr(self._own, alias)

    def __setattr__(self, alias: str, value: Any) -> None:
        setattr(self._own, alias, value)

    def __delattr__(self, alias: str) -> None:
        delattr(self._own, alias)


def _route_connections() -> None:
    """Have ``connections`` ask the body's context first (once per process)."""
    with _install:
        if not isinstance(connections._connections, _BodysConnections):
            connections._connections = _BodysConnections(connections._connections)


def _settings_for_the_body(settings_dict: dict[str, Any]) -> dict[str, Any]:
    """The alias's settings for a connection that lives as long as one body.

    No pool (the connection is the lock's, never a pooled one), no age limit or
    health check (the lock's monitor watches the session).
    """
    options = {key: value for key, value in settings_dict["OPTIONS"].items() if key != "pool"}
    return {
        **settings_dict,
        "OPTIONS": options,
        "CONN_MAX_AGE": None,
        "CONN_HEALTH_CHECKS": False,
    }


@functools.cache
def fenced_class(backend: type) -> type:
    """The backend's DatabaseWrapper class, its connection and transactions the lock's."""
    return type(
        f"Fenced{backend.__name__}",
        (FencedWrapper, backend),
        {"__module__": __name__, "pglock_backend": backend},
    )


@functools.cache
def fenced_cursor_class(cursor: type) -> type:
    """The psycopg cursor class ``cursor`` (Django's), its statements fenced. No slot
    added: a cursor made of ``cursor`` can be given this class (psycopg's ServerCursor,
    which Django 4.2 makes named cursors of, has slots and no ``__dict__``)."""
    namespace = {"__module__": __name__, "__slots__": ()}
    return type(f"Fenced{cursor.__name__}", (FencedCursor, cursor), namespace)


class FencedCursor:
    """Mixed into a cursor on the lock's handle: every way it sends SQL is fenced.

    ``execute``, ``executemany``, ``copy`` and ``stream`` (and ``callproc``, which
    executes) run inside the fenced transaction Django began, or inside one of
    their own in autocommit: whether reached through Django's cursor wrapper,
    through the psycopg cursor under it, or through the handle's ``execute()``.
    """

    __slots__ = ()
    connection: Any  # the lock's handle, with its pglock_statement()

    def execute(self, query: Any, *args: Any, **kwargs: Any) -> Any:
        with self.connection.pglock_statement(query):
            return super().execute(query, *args, **kwargs)  # type: ignore[misc]

    def executemany(self, *args: Any, **kwargs: Any) -> Any:
        with self.connection.pglock_statement():
            return super().executemany(*args, **kwargs)  # type: ignore[misc]

    @contextlib.contextmanager
    def copy(self, *args: Any, **kwargs: Any) -> Iterator[Any]:
        with self.connection.pglock_statement(), super().copy(*args, **kwargs) as copy:  # type: ignore[misc]
            yield copy

    def stream(self, *args: Any, **kwargs: Any) -> Iterator[Any]:
        with self.connection.pglock_statement():
            yield from super().stream(*args, **kwargs)  # type: ignore[misc]


def _cursor_class(wrapper: Any, conn_params: dict[str, Any]) -> type:
    """The cursor class Django gives its connections: in the parameters from Django 5.0
    on; chosen by Django 4.2's get_new_connection itself, as here."""
    if "cursor_factory" in conn_params:
        return conn_params["cursor_factory"]  # type: ignore[no-any-return]
    from django.db.backends.postgresql import base  # type: ignore[import-untyped]

    binding = wrapper.settings_dict["OPTIONS"].get("server_side_binding") is True
    return base.ServerBindingCursor if binding else base.Cursor  # type: ignore[no-any-return]


def use_adapters(handle: psycopg.Connection[Any], template: AdaptersMap) -> None:
    """Give ``handle`` the adapters of ``template``, as ``psycopg.connect(context=...)`` does.

    The one private attribute of psycopg used here (``Connection._adapters``):
    Django's adapters (JSON as text, its ranges, the time zone) come as a connect
    argument, and the lock's handle is made over a session already open.
    tests/unit/test_django_fence.py fails when a release changes it.
    """
    handle._adapters = AdaptersMap(template)


class FencedWrapper:
    """Mixed into a PostgreSQL DatabaseWrapper: the lock's connection, fenced commits.

    ``_fenced`` is the open ``lock.transaction()`` of the transaction Django began,
    None between transactions; the psycopg handle itself stays in autocommit.
    """

    pglock_lock: AdvisoryLock
    #: Taken to change ``_user``.
    pglock_turn: threading.Lock
    #: The thread (and greenlet) whose transaction or statement is under way, if any:
    #: no other may use the connection meanwhile (see _take_turn).
    _user: tuple[int, int] | None = None
    _fenced: AbstractContextManager[psycopg.Connection[Any]] | None = None
    #: While the lock's own statements run on the handle (its proof, BEGIN, COMMIT):
    #: they pass the cursors' fence.
    _library = False
    #: While Django sets up the connection it opened (init_connection_state): its
    #: time-zone statement passes the fence.
    _setting_up = False

    # The attributes of Django's DatabaseWrapper used here.
    settings_dict: dict[str, Any]
    ops: Any
    isolation_level: Any
    execute_wrappers: list[Callable[..., Any]]
    wrap_database_errors: AbstractContextManager[None]
    get_autocommit: Callable[[], bool]
    connection: psycopg.Connection[Any] | None

    alias: str

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.pglock_turn = threading.Lock()
        self.execute_wrappers.append(self._fence_statement)

    def validate_thread_sharing(self) -> None:
        """Any thread of the body's context may use it (asgiref's, asyncio's), one at a
        time: Django's check that only its creating thread does becomes the turn's."""
        self._refuse_another_thread()

    def _refuse_another_thread(self) -> None:
        user = self._user
        if user is not None and user != _caller():
            raise PglockError(
                f"lock {self.pglock_lock.label}: the task body's connection to the database "
                f"{self.alias!r} (pglock_database) is in use by another thread of the body "
                "(a transaction or statement of its is under way): the body's ORM calls run "
                "on its lock session one thread at a time, so this one is refused rather "
                "than sent through another connection (docs/limits.md, limit 9)"
            )

    def _take_turn(self) -> bool:
        """The caller's turn until _give_turn (True), or already its own (False); refused
        while another thread has it."""
        with self.pglock_turn:
            self._refuse_another_thread()
            if self._user is not None:
                return False
            self._user = _caller()
            return True

    def _give_turn(self) -> None:
        with self.pglock_turn:
            self._user = None

    def get_new_connection(self, conn_params: dict[str, Any]) -> psycopg.Connection[Any]:
        """The lock's handle, configured as Django configures a connection it opens."""
        handle = self.pglock_lock.connection
        level = self.settings_dict["OPTIONS"].get("isolation_level")
        self.isolation_level = (
            IsolationLevel.READ_COMMITTED if level is None else IsolationLevel(level)
        )
        if level is not None:
            handle.isolation_level = self.isolation_level
        handle.cursor_factory = fenced_cursor_class(_cursor_class(self, conn_params))
        handle.prepare_threshold = conn_params["prepare_threshold"]
        use_adapters(handle, conn_params["context"])
        # For its cursors (FencedCursor).
        handle.pglock_statement = self._statement_fence  # type: ignore[attr-defined]
        return handle

    def init_connection_state(self) -> None:
        """Django's set-up of the connection it opened, under the caller's turn.

        Its time-zone statement (``ops.set_time_zone_sql()``, the text Django sends)
        sets a session setting and writes no data: it is sent alone, one round trip,
        not as a fenced transaction of its own on every call (each release's DISCARD
        ALL resets the zone, so every body's connection sets it again). Any other
        statement sent here (assume_role's SET ROLE, a backend's own) stays fenced.
        The turn keeps every other thread's statement out meanwhile.
        """
        taken = self._take_turn()
        self._setting_up = True
        try:
            super().init_connection_state()  # type: ignore[misc]
        finally:
            self._setting_up = False
            if taken:
                self._give_turn()

    def _set_autocommit(self, autocommit: bool) -> None:
        """Autocommit off: the fenced transaction begins now, before any statement
        (whatever path the first takes); on again only once it has ended."""
        if autocommit and self._fenced is not None:
            with self.wrap_database_errors:
                raise psycopg.ProgrammingError(
                    "cannot turn autocommit on inside a transaction: commit or roll back first"
                )
        if not autocommit and self._fenced is None:
            self._begin()

    def create_cursor(self, name: str | None = None) -> Any:
        self._raise_if_lost(None)
        try:
            cursor = super().create_cursor(name)  # type: ignore[misc]
        except DatabaseError as exc:
            self._raise_if_lost(exc)
            raise
        if not isinstance(cursor, FencedCursor):
            # A named (server-side) cursor, which Django makes of its own class.
            made: type = type(cursor)
            cursor.__class__ = fenced_cursor_class(made)
        return cursor

    @contextlib.contextmanager
    def _statement_fence(self, query: Any = None) -> Iterator[None]:
        """Around each statement (``query`` when executed): inside the open fenced
        transaction, which SQL of the body's own must not have ended (COMMIT or
        ROLLBACK through a cursor), or inside a fenced transaction of its own in
        autocommit; the lock's own statements and Django's time-zone set-up as they are."""
        self._refuse_another_thread()
        if self._library or (self._setting_up and query == self.ops.set_time_zone_sql()):
            yield
            return
        if self._fenced is None:
            taken = self._take_turn()
            try:
                fenced = self._enter()
                try:
                    yield
                except BaseException as exc:
                    self._exit(fenced, exc)
                    raise
                self._exit(fenced, None)
            finally:
                if taken:
                    self._give_turn()
            return
        self._refuse_an_ended_transaction()
        yield
        self._refuse_an_ended_transaction()

    def _refuse_an_ended_transaction(self) -> None:
        handle = self.connection
        if handle is not None and handle.pgconn.transaction_status == pq.TransactionStatus.IDLE:
            self._raise_if_lost(None)
            raise PglockError(
                f"lock {self.pglock_lock.label}: SQL of the body's own ended the fenced "
                "transaction (COMMIT or ROLLBACK through a cursor), so what follows would "
                "not be fenced: end transactions with transaction.atomic() only"
            )

    def _fence_statement(
        self, execute: Callable[..., Any], sql: Any, params: Any, many: bool, context: Any
    ) -> Any:
        """A database error of a statement on a lost lock's session is LockLost (the
        statement itself is fenced by its cursor: FencedCursor)."""
        try:
            return execute(sql, params, many, context)
        except DatabaseError as exc:
            self._raise_if_lost(exc)
            raise

    def _enter(self) -> AbstractContextManager[psycopg.Connection[Any]]:
        """Begin a ``lock.transaction()`` (its proof runs on the handle, unfenced)."""
        fenced = self.pglock_lock.transaction()
        with library_code(), self._the_locks_own():
            fenced.__enter__()
        return fenced

    def _exit(
        self, fenced: AbstractContextManager[psycopg.Connection[Any]], error: BaseException | None
    ) -> None:
        """End ``fenced``: its commit (LockLost and a rollback unless the lock is
        proven), or its rollback after ``error``."""
        with library_code(), self._the_locks_own():
            fenced.__exit__(None if error is None else type(error), error, None)

    @contextlib.contextmanager
    def _the_locks_own(self) -> Iterator[None]:
        self._library = True
        try:
            yield
        finally:
            self._library = False

    def _begin(self) -> None:
        """The fenced transaction, the caller's turn until it ends."""
        taken = self._take_turn()
        try:
            self._fenced = self._enter()
        except BaseException:
            if taken:
                self._give_turn()
            raise

    def _commit(self) -> None:
        """COMMIT only once the lock is proven again (LockLost and a rollback otherwise)."""
        fenced, self._fenced = self._fenced, None
        if fenced is not None:
            try:
                with debug_transaction(self, "COMMIT"), self.wrap_database_errors:
                    self._exit(fenced, None)
            finally:
                self._give_turn()

    def _rollback(self) -> None:
        """Roll back; on a lost lock's cut session there is nothing left to roll back."""
        fenced, self._fenced = self._fenced, None
        if fenced is not None:
            try:
                with (
                    contextlib.suppress(LockLost),
                    debug_transaction(self, "ROLLBACK"),
                    self.wrap_database_errors,
                ):
                    self._exit(fenced, _RolledBack())
            finally:
                self._give_turn()

    def _close(self) -> None:
        self._rollback()
        if self.connection is not None:
            with self.wrap_database_errors:
                self.connection.close()  # revokes this handle, never the session

    def _raise_if_lost(self, error: DatabaseError | None) -> None:
        """Raise LockLost when the lock is found lost (after ``error``, asked first)."""
        lock = self.pglock_lock
        if error is not None and lock.loss is None and lock.held():
            return
        loss = lock.loss
        if loss is not None:
            raise LockLost(
                f"lock {lock.label} was lost: {loss}; the ORM's writes since are not committed"
            ) from error
