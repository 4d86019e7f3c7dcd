"""InstallGuard and RemoveGuard as Django's migration machinery sees them (no database)."""

from __future__ import annotations

import pytest

from pglock_celery.django.operations import InstallGuard, RemoveGuard
from pglock_celery.exceptions import ConfigurationError


def test_install_guard_deconstructs_to_the_call_that_made_it() -> None:
    operation = InstallGuard(model_name="Ledger", lock_name="shop:{tenant}")
    name, args, kwargs = operation.deconstruct()
    assert (name, args) == ("InstallGuard", [])
    assert InstallGuard(**kwargs).deconstruct() == operation.deconstruct()
    assert operation.reversible
    assert operation.migration_name_fragment == "guard_ledger"


def test_a_bad_template_is_refused_as_the_migration_loads() -> None:
    with pytest.raises(ConfigurationError):
        InstallGuard(model_name="Ledger", lock_name="shop:{tenant")
    with pytest.raises(ConfigurationError):
        RemoveGuard(model_name="Ledger", lock_name="shop:{")


def test_remove_guard_is_reversible_when_it_knows_the_template_to_put_back() -> None:
    assert RemoveGuard(model_name="Ledger", lock_name="shop:{tenant}").reversible
    bare = RemoveGuard(model_name="Ledger")
    assert not bare.reversible
    assert bare.deconstruct() == ("RemoveGuard", [], {"model_name": "Ledger"})
    with pytest.raises(ConfigurationError, match="lock_name"):
        bare.database_backwards("shop", None, None, None)
