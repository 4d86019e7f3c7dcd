"""Guarded tables from a Django migration: ``InstallGuard`` and ``RemoveGuard``.

::

    from pglock_celery.django.operations import InstallGuard

    class Migration(migrations.Migration):
        dependencies = [("shop", "0001_initial")]
        operations = [InstallGuard(model_name="Ledger", lock_name="shop:{tenant}")]

Each runs :func:`pglock_celery.install_guard` (or ``remove_guard``) on the migration's own
connection, so the guard commits or rolls back with the migration; unapplying one does
the reverse. ``lock_name`` is a template over the model's column names (``tenant_id`` for
a foreign key ``tenant``), as ``install_guard`` takes it. A database the router keeps the
model off is left alone.
"""

from __future__ import annotations

from typing import Any

import psycopg
from django.db.migrations.operations.base import Operation  # type: ignore[import-untyped]

from ..exceptions import ConfigurationError
from ..guard import install_guard, parse_template, remove_guard


def _psycopg_connection(schema_editor: Any) -> psycopg.Connection[Any]:
    """The psycopg connection under the migration's database connection."""
    connection = schema_editor.connection
    if connection.vendor != "postgresql":
        raise ConfigurationError(
            f"a guarded table needs Postgres: database {connection.alias!r} is {connection.vendor}"
        )
    connection.ensure_connection()
    raw = connection.connection
    if not isinstance(raw, psycopg.Connection):
        raise ConfigurationError(
            f"a guarded table from a migration needs Django's psycopg (3) backend: database "
            f"{connection.alias!r} runs on {type(raw).__module__}; install psycopg"
        )
    return raw


def _table(schema_editor: Any, model: Any) -> str:
    """The model's table as SQL (quoted: a db_table may carry capitals or dots)."""
    return str(schema_editor.quote_name(model._meta.db_table))


class _GuardOperation(Operation):  # type: ignore[misc]
    """What both operations do: install or remove a model's guard on the migration's own
    connection, where the router lets the model be migrated."""

    reduces_to_sql = False
    model_name: str

    def state_forwards(self, app_label: str, state: Any) -> None:
        """A guard changes no model."""

    def _install(self, app_label: str, schema_editor: Any, state: Any, lock_name: str) -> None:
        model = state.apps.get_model(app_label, self.model_name)
        if self.allow_migrate_model(schema_editor.connection.alias, model):
            conn = _psycopg_connection(schema_editor)
            install_guard(conn, _table(schema_editor, model), lock_name)

    def _remove(self, app_label: str, schema_editor: Any, state: Any) -> None:
        model = state.apps.get_model(app_label, self.model_name)
        if self.allow_migrate_model(schema_editor.connection.alias, model):
            remove_guard(_psycopg_connection(schema_editor), _table(schema_editor, model))


class InstallGuard(_GuardOperation):
    """Guard a model's table: a write to a row needs the lock ``lock_name`` names for it."""

    reversible = True

    def __init__(self, model_name: str, lock_name: str) -> None:
        parse_template(lock_name)  # a bad template fails as the migration loads
        self.model_name = model_name
        self.lock_name = lock_name

    def deconstruct(self) -> tuple[str, list[Any], dict[str, Any]]:
        kwargs = {"model_name": self.model_name, "lock_name": self.lock_name}
        return type(self).__qualname__, [], kwargs

    def database_forwards(
        self, app_label: str, schema_editor: Any, from_state: Any, to_state: Any
    ) -> None:
        self._install(app_label, schema_editor, to_state, self.lock_name)

    def database_backwards(
        self, app_label: str, schema_editor: Any, from_state: Any, to_state: Any
    ) -> None:
        self._remove(app_label, schema_editor, from_state)

    def describe(self) -> str:
        return f"Guard {self.model_name}'s table with lock {self.lock_name!r}"

    @property
    def migration_name_fragment(self) -> str:
        return f"guard_{self.model_name.lower()}"


class RemoveGuard(_GuardOperation):
    """Remove a model's guard; unapplied, it installs ``lock_name`` again (when given)."""

    def __init__(self, model_name: str, lock_name: str | None = None) -> None:
        if lock_name is not None:
            parse_template(lock_name)
        self.model_name = model_name
        self.lock_name = lock_name

    @property
    def reversible(self) -> bool:
        """Reversible when it knows the template to put back."""
        return self.lock_name is not None

    def deconstruct(self) -> tuple[str, list[Any], dict[str, Any]]:
        kwargs: dict[str, Any] = {"model_name": self.model_name}
        if self.lock_name is not None:
            kwargs["lock_name"] = self.lock_name
        return type(self).__qualname__, [], kwargs

    def database_forwards(
        self, app_label: str, schema_editor: Any, from_state: Any, to_state: Any
    ) -> None:
        self._remove(app_label, schema_editor, to_state)

    def database_backwards(
        self, app_label: str, schema_editor: Any, from_state: Any, to_state: Any
    ) -> None:
        if self.lock_name is None:
            raise ConfigurationError(
                f"RemoveGuard(model_name={self.model_name!r}) cannot be unapplied: give it "
                "the lock_name to install again"
            )
        self._install(app_label, schema_editor, to_state, self.lock_name)

    def describe(self) -> str:
        return f"Remove the guard of {self.model_name}'s table"

    @property
    def migration_name_fragment(self) -> str:
        return f"unguard_{self.model_name.lower()}"
