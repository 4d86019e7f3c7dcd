"""``manage.py pglock locks|doctor|guard|key ...``: the pglock-celery command in a Django project.

Everything after ``pglock`` goes to the command as it is (``manage.py pglock doctor
--help``), with the settings of the project's Celery app (celery_settings.py):
``CELERY_PGLOCK_DATABASE`` or ``CELERY_PGLOCK_DSN``, else ``PGLOCK_DSN``.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from django.core.management.base import (  # type: ignore[import-untyped]
    BaseCommand,
    CommandError,
)

from ....cli import main
from ...celery_settings import settings_app

#: manage.py's own options, already applied by the time a command runs.
_DJANGO_OPTIONS = ("--settings", "--pythonpath")


def _without_django_options(arguments: list[str]) -> list[str]:
    kept: list[str] = []
    skip = False
    for argument in arguments:
        if skip:
            skip = False
        elif argument in _DJANGO_OPTIONS:
            skip = True
        elif not argument.startswith(tuple(f"{option}=" for option in _DJANGO_OPTIONS)):
            kept.append(argument)
    return kept


class Command(BaseCommand):  # type: ignore[misc]
    help = "pglock-celery's command: locks, key, doctor, guard (manage.py pglock --help)"
    requires_system_checks = ()  # doctor reports what the checks would

    def run_from_argv(self, argv: list[str]) -> None:
        prog = f"{os.path.basename(argv[0])} pglock"
        raise SystemExit(main(_without_django_options(argv[2:]), app=settings_app(), prog=prog))

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("arguments", nargs=argparse.REMAINDER)

    def handle(self, *args: Any, **options: Any) -> None:
        """``call_command("pglock", "locks")``: CommandError on a non-zero status."""
        status = main([*args, *options["arguments"]], app=settings_app(), prog="pglock")
        if status:
            raise CommandError(f"pglock exited with status {status}", returncode=status)
