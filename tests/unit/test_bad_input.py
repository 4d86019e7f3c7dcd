"""Bad input is refused with a clear error before any connection is tried.

NOWHERE is a DSN nothing answers on: a test that passes proves no connection was needed.
"""

from __future__ import annotations

from typing import Any

import pytest
from celery import Celery

from pglock_celery import ConfigurationError, LockNameError, TenantLockedTask, try_lock, wait_lock

NOWHERE = "host=127.0.0.1 port=1 user=nobody dbname=none connect_timeout=2"


@pytest.fixture
def eager_app() -> Celery:
    app = Celery("bad-input", set_as_current=False, broker="memory://", backend="cache+memory://")
    app.conf.update(pglock_dsn=NOWHERE, task_store_eager_result=True)
    return app


@pytest.mark.parametrize("name", ["", "a\x00b"])
def test_a_bad_name_is_refused_before_connecting(name: str) -> None:
    with pytest.raises(LockNameError):
        try_lock(name, dsn=NOWHERE)
    with pytest.raises(LockNameError):
        wait_lock(name, dsn=NOWHERE)


@pytest.mark.parametrize("timeout", [float("inf"), float("nan"), 1e10, -1])
def test_a_bad_timeout_is_refused_before_connecting(timeout: float) -> None:
    with pytest.raises(ValueError, match="lock timeout"):
        wait_lock("t", dsn=NOWHERE, timeout=timeout)


@pytest.mark.parametrize("timeout", [float("inf"), float("nan"), 1e10])
def test_a_bad_lock_timeout_option_is_a_configuration_error(
    eager_app: Celery, timeout: float
) -> None:
    @eager_app.task(base=TenantLockedTask, lock_mode="wait", lock_timeout=timeout, shared=False)
    def step(tenant_id: int) -> str:
        return "ran"

    with pytest.raises(ConfigurationError, match="lock_timeout"):
        step(1)


@pytest.mark.parametrize(
    ("template", "argument"), [("t:{tenant_id[0]}", 7), ("t:{tenant_id:d}", "x")]
)
def test_a_template_that_cannot_format_the_call_is_a_lock_name_error(
    eager_app: Celery, template: str, argument: Any
) -> None:
    @eager_app.task(base=TenantLockedTask, lock_name=template, shared=False)
    def step(tenant_id: Any) -> str:
        return "ran"

    with pytest.raises(LockNameError, match="cannot be formatted"):
        step(argument)


def test_a_nul_from_the_call_is_a_lock_name_error(eager_app: Celery) -> None:
    @eager_app.task(base=TenantLockedTask, shared=False)
    def step(tenant_id: Any) -> str:
        return "ran"

    with pytest.raises(LockNameError, match="NUL"):
        step("a\x00b")
