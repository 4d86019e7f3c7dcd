"""Where a task body's ORM writes meet its lock (``pglock_database``, Django)."""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .config import PglockConfig
    from .lock import AdvisoryLock


def fence_orm(lock: AdvisoryLock, config: PglockConfig) -> AbstractContextManager[None]:
    """While the body runs: its ORM writes to ``pglock_database`` fenced by ``lock``.

    Nothing without that setting (Django is imported only with it); see
    django/fence.py for how.
    """
    if config.database is None:
        return contextlib.nullcontext()
    from .django.fence import fenced_orm

    return fenced_orm(lock, config.database)
