"""CI detection: any usual spelling of "yes" makes a missing capability fail, not skip."""

from __future__ import annotations

import pytest

from tests.support.ci import in_ci


@pytest.mark.parametrize("value", ["true", "True", "TRUE", "1", "yes", "Yes", " true "])
def test_ci_is_detected_from_every_usual_spelling(value: str) -> None:
    assert in_ci({"CI": value})


@pytest.mark.parametrize("value", ["", "0", "false", "no", "off"])
def test_anything_else_is_not_ci(value: str) -> None:
    assert not in_ci({"CI": value})


def test_no_ci_variable_is_not_ci() -> None:
    assert not in_ci({})
