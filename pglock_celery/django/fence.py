"""A task body's ORM writes fenced by its lock (``pglock_database``).

For the body's length, this thread's (or greenlet's) ``connections[alias]`` is a
DatabaseWrapper of the alias's own backend class whose psycopg connection is the
lock's own handle (``lock.connection``). Every ORM statement to that database
then runs on the lock session, and every one is inside ``lock.transaction()``: a
transaction Django begins (``atomic()``, or autocommit turned off) is one from its
first statement to its COMMIT, and a statement in autocommit is one of its own. So
a write commits only if the lock is proven at the transaction's start and again
before its COMMIT; after a loss the session is cut, and nothing more commits.

Django's own code configures the connection (its cursor class, its adapters and
time zone, ``assume_role``): only where the connection comes from and how a
transaction begins and ends are replaced. The caller's wrapper is put back after
the body, untouched: Celery's Django fixup closes connections before and after a
task, outside this, and never sees the lock's.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
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
from ..shield import library_code

if TYPE_CHECKING:
    from ..lock import AdvisoryLock


class _RolledBack(Exception):
    """Thrown into a fenced transaction to end it with a rollback."""


@contextlib.contextmanager
def fenced_orm(lock: AdvisoryLock, alias: str) -> Iterator[None]:
    """While the body runs: ``connections[alias]`` is the lock's session, its commits fenced.

    Refused (PglockError) when this thread is already inside ``atomic()`` on that
    alias (an eager call made in a transaction): the body's writes could not join
    that transaction under the lock, and would wait on its row locks.
    """
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
    connections[alias] = wrapper
    try:
        yield
    finally:
        connections[alias] = original
        with contextlib.suppress(DatabaseError, PglockError):
            wrapper.close()  # rolls back what is still open; the release revokes the handle


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
    """The psycopg cursor class ``cursor`` (Django's), its statements fenced."""
    return type(f"Fenced{cursor.__name__}", (FencedCursor, cursor), {"__module__": __name__})


class FencedCursor:
    """Mixed into a cursor on the lock's handle: every way it sends SQL is fenced.

    ``execute``, ``executemany``, ``copy`` and ``stream`` (and ``callproc``, which
    executes) run inside the fenced transaction Django began, or inside one of
    their own in autocommit: whether reached through Django's cursor wrapper,
    through the psycopg cursor under it, or through the handle's ``execute()``.
    """

    __slots__ = ()
    connection: Any  # the lock's handle, with its pglock_statement()

    def execute(self, *args: Any, **kwargs: Any) -> Any:
        with self.connection.pglock_statement():
            return super().execute(*args, **kwargs)  # type: ignore[misc]

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
    _fenced: AbstractContextManager[psycopg.Connection[Any]] | None = None
    #: While the lock's own statements run on the handle (its proof, BEGIN, COMMIT):
    #: they pass the cursors' fence.
    _library = False

    # The attributes of Django's DatabaseWrapper used here.
    settings_dict: dict[str, Any]
    isolation_level: Any
    execute_wrappers: list[Callable[..., Any]]
    wrap_database_errors: AbstractContextManager[None]
    get_autocommit: Callable[[], bool]
    connection: psycopg.Connection[Any] | None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.execute_wrappers.append(self._fence_statement)

    def get_new_connection(self, conn_params: dict[str, Any]) -> psycopg.Connection[Any]:
        """The lock's handle, configured as Django configures a connection it opens."""
        handle = self.pglock_lock.connection
        level = self.settings_dict["OPTIONS"].get("isolation_level")
        self.isolation_level = (
            IsolationLevel.READ_COMMITTED if level is None else IsolationLevel(level)
        )
        if level is not None:
            handle.isolation_level = self.isolation_level
        handle.cursor_factory = fenced_cursor_class(conn_params["cursor_factory"])
        handle.prepare_threshold = conn_params["prepare_threshold"]
        use_adapters(handle, conn_params["context"])
        # For its cursors (FencedCursor).
        handle.pglock_statement = self._statement_fence  # type: ignore[attr-defined]
        return handle

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
    def _statement_fence(self) -> Iterator[None]:
        """Around each statement: inside the open fenced transaction, which SQL of the
        body's own must not have ended (COMMIT or ROLLBACK through a cursor), or inside
        a fenced transaction of its own in autocommit."""
        if self._library:
            yield
            return
        if self._fenced is None:
            fenced = self._enter()
            try:
                yield
            except BaseException as exc:
                self._exit(fenced, exc)
                raise
            self._exit(fenced, None)
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
        self._fenced = self._enter()

    def _commit(self) -> None:
        """COMMIT only once the lock is proven again (LockLost and a rollback otherwise)."""
        fenced, self._fenced = self._fenced, None
        if fenced is not None:
            with debug_transaction(self, "COMMIT"), self.wrap_database_errors:
                self._exit(fenced, None)

    def _rollback(self) -> None:
        """Roll back; on a lost lock's cut session there is nothing left to roll back."""
        fenced, self._fenced = self._fenced, None
        if fenced is not None:
            with (
                contextlib.suppress(LockLost),
                debug_transaction(self, "ROLLBACK"),
                self.wrap_database_errors,
            ):
                self._exit(fenced, _RolledBack())

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
