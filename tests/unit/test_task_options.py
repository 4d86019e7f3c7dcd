"""Lock names from a call's arguments, and clear errors before any lock is taken."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery

from pglock_celery import ConfigurationError, LockNameError, PglockError, TenantLockedTask
from pglock_celery.task import configuration_problems


@pytest.fixture
def app(monkeypatch: pytest.MonkeyPatch) -> Iterator[Celery]:
    monkeypatch.delenv("PGLOCK_DSN", raising=False)
    app = Celery("unit", set_as_current=False, broker="memory://", backend="cache+memory://")
    app.conf.task_store_eager_result = True
    app.conf.pglock_dsn = "host=127.0.0.1 dbname=x"  # locked tasks need one to start
    yield app


def make(app: Celery, **options: Any) -> TenantLockedTask:
    @app.task(base=TenantLockedTask, shared=False, **options)
    def step(tenant_id: Any, stage: str = "train", **extra: Any) -> str:
        return "ran"

    return step  # type: ignore[return-value]


def test_template_sees_positional_keyword_and_default_arguments(app: Celery) -> None:
    task = make(app, lock_name="{tenant_id}:{stage}:{region}")
    assert task.resolve_lock_name((7,), {"region": "eu"}) == "7:train:eu"
    assert task.resolve_lock_name((), {"tenant_id": 7, "stage": "eval", "region": "eu"}) == (
        "7:eval:eu"
    )


def test_default_name_is_tenant_colon_id(app: Celery) -> None:
    assert make(app).resolve_lock_name((42,), {}) == "tenant:42"


def test_uuid_arguments_format_as_their_str(app: Celery) -> None:
    tenant = uuid.UUID("12345678-1234-5678-1234-567812345678")
    assert make(app).resolve_lock_name((tenant,), {}) == f"tenant:{tenant}"


def test_template_naming_a_missing_argument_names_task_and_argument(app: Celery) -> None:
    task = make(app, lock_name="tenant:{customer}")
    with pytest.raises(LockNameError, match=r"task .*step.*'customer'.*lacks"):
        task.resolve_lock_name((1,), {})


def test_arguments_that_do_not_fit_the_signature_are_reported(app: Celery) -> None:
    with pytest.raises(LockNameError, match="do not fit its signature"):
        make(app).resolve_lock_name((), {})


def test_callable_lock_name_gets_the_call_arguments(app: Celery) -> None:
    task = make(app, lock_name=lambda tenant_id, **kw: f"t-{tenant_id}-{kw.get('stage')}")
    assert task.resolve_lock_name((3,), {"stage": "x"}) == "t-3-x"


def test_callable_that_raises_names_the_task_and_the_error(app: Celery) -> None:
    def broken(*args: Any, **kwargs: Any) -> str:
        raise KeyError("region")

    with pytest.raises(LockNameError, match=r"task .*step.*KeyError"):
        make(app, lock_name=broken).resolve_lock_name((1,), {})


@pytest.mark.parametrize(("spec", "why"), [(lambda *a: "", "empty"), (lambda *a: 42, "int")])
def test_empty_or_non_str_names_are_refused(app: Celery, spec: Any, why: str) -> None:
    with pytest.raises(LockNameError, match=why):
        make(app, lock_name=spec).resolve_lock_name((1,), {})


def test_bad_name_fails_the_call_before_any_lock(app: Celery) -> None:
    app.conf.pglock_dsn = "host=127.0.0.1 port=1"  # would fail loudly if it were used
    result = make(app, lock_name="tenant:{nope}").apply((1,))
    assert result.failed()
    assert isinstance(result.result, PglockError)
    assert "nope" in str(result.result)


def test_missing_dsn_is_found_at_start_and_fails_the_first_call_naming_it(app: Celery) -> None:
    app.conf.pglock_dsn = None
    task = make(app)
    assert any(
        problem.startswith("no lock database configured") for problem in configuration_problems(app)
    )
    result = task.apply((1,))
    assert isinstance(result.result, ConfigurationError)
    assert "pglock_dsn" in str(result.result) and "PGLOCK_DSN" in str(result.result)


def test_unknown_lock_mode_is_a_configuration_error(app: Celery) -> None:
    app.conf.pglock_dsn = "host=127.0.0.1 port=1"
    result = make(app, lock_mode="block").apply((1,))
    assert isinstance(result.result, ConfigurationError)
    assert "lock_mode" in str(result.result)


def test_a_staticmethod_or_classmethod_lock_name_gets_the_call_arguments(app: Celery) -> None:
    class Static(TenantLockedTask):
        lock_name = staticmethod(lambda tenant_id, **kw: f"static:{tenant_id}")

    class Klass(TenantLockedTask):
        @classmethod
        def lock_name(cls, tenant_id: Any, **kw: Any) -> str:  # type: ignore[override]
            return f"{cls.__name__}:{tenant_id}"

    assert make_with(app, Static).resolve_lock_name((4,), {}) == "static:4"
    klass = make_with(app, Klass)
    assert klass.resolve_lock_name((5,), {}) == "step:5"  # the task class, not the base


def make_with(app: Celery, base: type[TenantLockedTask]) -> TenantLockedTask:
    @app.task(base=base, shared=False, name=f"step_{base.__name__}")
    def step(tenant_id: Any, stage: str = "train", **extra: Any) -> str:
        return "ran"

    return step  # type: ignore[return-value]


def test_a_missing_argument_lists_the_arguments_the_call_has(app: Celery) -> None:
    @app.task(base=TenantLockedTask, lock_name="tenant:{customer}", shared=False)
    def bare() -> str:
        return "ran"

    with pytest.raises(LockNameError, match=r"it has: tenant_id, stage\)$"):
        make(app, lock_name="tenant:{customer}").resolve_lock_name((1,), {})
    with pytest.raises(LockNameError, match=r"it has: no arguments\)$"):
        bare.resolve_lock_name((), {})


def test_an_unknown_lock_mode_names_the_modes_there_are(app: Celery) -> None:
    app.conf.pglock_dsn = "host=127.0.0.1 port=1"
    result = make(app, lock_mode="block").apply((1,))
    assert str(result.result).endswith("lock_mode must be one of skip, wait, retry, not 'block'")


# Found at start: a worker refuses to start with any of these --------------------------------


def test_a_template_naming_an_argument_the_task_cannot_take_is_found_without_a_call(
    app: Celery,
) -> None:
    @app.task(base=TenantLockedTask, lock_name="tenant:{customer}:{stage}", shared=False)
    def plain(tenant_id: Any, stage: str = "x") -> str:
        return "ran"

    assert configuration_problems(app) == [
        f"task {plain.name}: lock_name 'tenant:{{customer}}:{{stage}}' names argument "
        "'customer', which the task cannot take (its parameters: tenant_id, stage)"
    ]


def test_the_default_template_on_a_task_without_tenant_id_is_found(app: Celery) -> None:
    @app.task(base=TenantLockedTask, shared=False)
    def sync(account: int) -> str:
        return "ran"

    [problem] = configuration_problems(app)
    assert "lock_name 'tenant:{tenant_id}' names argument 'tenant_id'" in problem


def test_a_template_over_any_name_is_fine_for_a_task_taking_keyword_arguments(
    app: Celery,
) -> None:
    make(app, lock_name="{tenant_id}:{region.code}:{tags[0]}")  # region arrives in **extra
    make_with(app, TenantLockedTask)
    assert configuration_problems(app) == []


@pytest.mark.parametrize(
    ("options", "why"),
    [
        ({"lock_mode": "block"}, "lock_mode must be one of skip, wait, retry, not 'block'"),
        ({"lock_mode": "wait", "lock_timeout": -1}, "lock_timeout: lock timeout must be 0"),
        ({"lock_mode": "wait", "lock_timeout": "5"}, "lock_timeout: lock timeout must be a nu"),
        ({"lock_retry_countdown": 0}, "lock_retry_countdown must be greater than 0, not 0"),
        ({"lock_retry_countdown": float("inf")}, "lock_retry_countdown must be a finite number"),
        ({"lock_retry_countdown": 1e12}, "lock_retry_countdown must be short enough that Celery"),
        ({"lock_retry_countdown": "5"}, "lock_retry_countdown must be a number of seconds above"),
        ({"lock_name": "tenant:{tenant_id"}, "lock_name 'tenant:{tenant_id' is not a valid t"),
        ({"lock_name": "tenant:{}"}, "lock_name 'tenant:{}' has a positional field"),
        ({"lock_name": "tenant:{0}"}, "lock_name 'tenant:{0}' has a positional field"),
        ({"lock_name": 42}, "lock_name must be a str.format template or a callable, not int"),
    ],
)
def test_a_bad_task_option_is_found_without_a_call_naming_task_and_option(
    app: Celery, options: dict[str, Any], why: str
) -> None:
    task = make(app, **options)
    [problem] = configuration_problems(app)
    assert problem.startswith(f"task {task.name}: {why}"), problem


def test_an_invalid_setting_is_found_with_the_task_problems(app: Celery) -> None:
    app.conf.update(pglock_on_lost="kill", pglock_strategy="pooled")
    make(app, lock_mode="block")
    problems = configuration_problems(app)
    assert problems[0] == (
        "invalid settings: pglock_on_lost='kill': must be 'interrupt', 'raise' or 'terminate';"
        " pglock_strategy='pooled': must be 'connect', 'reuse' or 'shared'"
    )
    assert problems[1].endswith("lock_mode must be one of skip, wait, retry, not 'block'")


def test_a_malformed_dsn_is_found_at_start_and_fails_the_first_lock_closed(app: Celery) -> None:
    app.conf.pglock_dsn = "postgresql://u:Pw9x/7Zq@h/db"
    task = make(app)
    [problem] = configuration_problems(app)
    assert "not a valid connection string" in problem and "Pw9x" not in problem
    result = task.apply((1,))
    assert isinstance(result.result, ConfigurationError)
    assert "not a valid connection string" in str(result.result)
    assert "Pw9x" not in str(result.result)


def test_a_well_configured_app_has_no_problem(app: Celery) -> None:
    app.conf.pglock_dsn = "host=127.0.0.1 dbname=x"
    make(app)
    make(app, lock_name=lambda tenant_id, **kw: f"t:{tenant_id}", name="by_callable")
    make(app, lock_mode="wait", lock_timeout=3, name="waits")
    assert configuration_problems(app) == []
