"""Errors raised by pglock-celery.

::

    PglockError
     +-- ConfigurationError   a pglock_* setting or a task option is missing or invalid
     +-- LockNameError        a call's lock name could not be resolved
     +-- LockUnavailable      no lock session could be opened or used (fail closed)
     +-- LockTimeout          the lock was not obtained in time
     +-- LockLost             a lock that was held is no longer held

Every error carries a plain message only, so it survives Celery's JSON result
serialisation and is rebuilt on the caller's side with the same text.
"""

from __future__ import annotations


class PglockError(Exception):
    """A pglock-celery operation failed."""

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message or (self.__doc__ or "").strip())


class ConfigurationError(PglockError):
    """A pglock setting or task option is missing or invalid."""


class LockNameError(PglockError):
    """The lock name of a call could not be resolved from its arguments."""


class LockUnavailable(PglockError):
    """No lock session could be opened or used; the step did not run."""


class LockTimeout(PglockError):
    """The lock was not obtained within the allowed time."""


class LockLost(PglockError):
    """The lock is no longer held by this session."""


for _cls in (
    PglockError,
    ConfigurationError,
    LockNameError,
    LockUnavailable,
    LockTimeout,
    LockLost,
):
    _cls.__module__ = "pglock_celery"
del _cls
