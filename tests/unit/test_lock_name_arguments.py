"""The lock name's arguments: the quick path for plain calls gives exactly what
Signature.bind with apply_defaults gives, and leaves every other call to it."""

from __future__ import annotations

import inspect
import uuid
from typing import Any

from celery import Celery
from hypothesis import given, settings
from hypothesis import strategies as st

from pglock_celery import TenantLockedTask

NAMES = ("a", "b", "c", "d")
KINDS = (
    inspect.Parameter.POSITIONAL_ONLY,
    inspect.Parameter.POSITIONAL_OR_KEYWORD,
    inspect.Parameter.KEYWORD_ONLY,
)


@st.composite
def signatures(draw: st.DrawFn) -> inspect.Signature:
    """Valid signatures over a few names: kinds in order, defaults only at the end of
    the positional ones, maybe *args and **kwargs."""
    count = draw(st.integers(0, len(NAMES)))
    kinds = sorted(draw(st.lists(st.sampled_from(KINDS), min_size=count, max_size=count)))
    parameters: list[inspect.Parameter] = []
    defaulted = False
    for name, kind in zip(NAMES, kinds, strict=False):
        if kind is inspect.Parameter.KEYWORD_ONLY:
            default = draw(st.sampled_from([inspect.Parameter.empty, f"{name}-default"]))
        else:
            defaulted = defaulted or draw(st.booleans())
            default = f"{name}-default" if defaulted else inspect.Parameter.empty
        parameters.append(inspect.Parameter(name, kind, default=default))
    if draw(st.booleans()):
        at = sum(p.kind is not inspect.Parameter.KEYWORD_ONLY for p in parameters)
        parameters.insert(at, inspect.Parameter("rest", inspect.Parameter.VAR_POSITIONAL))
    if draw(st.booleans()):
        parameters.append(inspect.Parameter("extra", inspect.Parameter.VAR_KEYWORD))
    return inspect.Signature(parameters)


def task_with(signature: inspect.Signature) -> TenantLockedTask:
    app = Celery(f"names{uuid.uuid4().hex[:6]}", set_as_current=False, broker="memory://")

    def step(*args: Any, **kwargs: Any) -> None:
        return None

    step.__signature__ = signature  # type: ignore[attr-defined]
    return app.task(base=TenantLockedTask, shared=False, lock_name="x")(step)  # type: ignore[no-any-return]


@settings(max_examples=400, deadline=None)
@given(
    signature=signatures(),
    args=st.lists(st.integers(), max_size=5),
    kwargs=st.dictionaries(st.sampled_from((*NAMES, "rest", "extra", "z")), st.integers()),
)
def test_the_quick_path_agrees_with_bind(
    signature: inspect.Signature, args: list[int], kwargs: dict[str, int]
) -> None:
    task = task_with(signature)
    quick = task._simple_arguments(tuple(args), kwargs)
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError:
        assert quick is None, (
            f"{signature}{args}{kwargs}: bind refuses, the quick path gave {quick}"
        )
        return
    bound.apply_defaults()
    if quick is not None:
        assert quick == dict(bound.arguments)
    plain_kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    if all(p.kind in plain_kinds for p in signature.parameters.values()):
        assert quick is not None, f"{signature}{args}{kwargs}: a plain call took the slow path"
