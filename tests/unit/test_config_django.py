"""A Celery app configured from Django's settings follows override_settings."""

from __future__ import annotations

from collections.abc import Iterator

import django
import pytest
from celery import Celery
from django.conf import settings
from django.test import override_settings

from pglock_celery import ConfigurationError
from pglock_celery.config import get_config


@pytest.fixture
def django_app() -> Iterator[Celery]:
    """The app of a Django project, as Celery's Django guide sets it up.

    Django is configured once per process (another module may have done it first):
    the project's own settings are applied with override_settings.
    """
    if not settings.configured:
        settings.configure()
        django.setup()
    with override_settings(CELERY_BROKER_URL="memory://", CELERY_PGLOCK_CHECK_INTERVAL=3):
        app = Celery("django_project", set_as_current=False)
        app.config_from_object("django.conf:settings", namespace="CELERY")
        yield app


def test_override_settings_counts_at_the_next_call(
    django_app: Celery, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PGLOCK_DSN", raising=False)
    with pytest.raises(ConfigurationError, match="no lock database"):
        get_config(django_app).require_dsn()
    with override_settings(CELERY_PGLOCK_DSN="dbname=overridden"):
        assert get_config(django_app).require_dsn() == "dbname=overridden"
        with override_settings(CELERY_PGLOCK_CHECK_INTERVAL=9):
            assert get_config(django_app).check_interval == 9.0
        assert get_config(django_app).check_interval == 3.0
    assert get_config(django_app).dsn is None


def test_a_bad_django_setting_is_an_error_named_as_written(django_app: Celery) -> None:
    get_config(django_app)
    with override_settings(CELERY_PGLOCK_CHECK_INTERVAL="soon"):
        with pytest.raises(
            ConfigurationError, match=r"^invalid setting CELERY_PGLOCK_CHECK_INTERVAL='soon': "
        ):
            get_config(django_app)
    assert get_config(django_app).check_interval == 3.0  # fixed: counts at the next call
