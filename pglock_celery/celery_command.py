"""``celery -A proj pglock ...``: the pglock-celery command as a Celery sub-command.

Registered under Celery's ``celery.commands`` entry point group. Everything after
``pglock`` goes to the pglock-celery command as it is, with the app that
``celery -A`` loaded: ``celery -A proj pglock locks`` reads the app's
``pglock_dsn`` (else ``PGLOCK_DSN``), as the workers do.
"""

from __future__ import annotations

import click

from .cli import main


@click.command(
    "pglock",
    context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False},
    add_help_option=False,
)
@click.argument("arguments", nargs=-1, type=click.UNPROCESSED)
@click.pass_context
def pglock(ctx: click.Context, arguments: tuple[str, ...]) -> None:
    """Advisory locks of the app's pglock_dsn: locks, key, doctor and more (pglock --help)."""
    app = getattr(ctx.obj, "app", None)
    ctx.exit(main(list(arguments), app=app, prog="celery pglock"))
