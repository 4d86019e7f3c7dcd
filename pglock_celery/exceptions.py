"""Errors raised by pglock-celery.

::

    PglockError
     +-- ConfigurationError        a pglock_* setting or a task option is missing or invalid
     +-- LockArgumentError         (also ValueError) an argument has a value no lock takes:
     |    |                        a key outside 64 bits, a negative, NaN or too long timeout
     |    +-- LockNameError        a lock name is empty or holds a NUL, or a call's lock
     |                             name could not be resolved from its arguments
     +-- LockArgumentTypeError     (also TypeError) an argument has a type no lock takes:
     |                             a lock that is neither a str name nor an int key, a
     |                             timeout that is not a number of seconds
     +-- LockUnavailable           no lock session could be opened or used (fail closed)
     +-- LockTimeout               the lock was not obtained in time
     +-- LockLost                  a lock that was held is no longer held

Bad arguments are caught by ``except PglockError`` and by the builtin a Python
user expects (``except ValueError``, ``except TypeError``) alike.

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


class LockArgumentError(PglockError, ValueError):
    """An argument has a value that no lock can take."""


class LockNameError(LockArgumentError):
    """The lock name of a call could not be resolved from its arguments."""


class LockArgumentTypeError(PglockError, TypeError):
    """An argument has a type that no lock can take."""


class LockUnavailable(PglockError):
    """No lock session could be opened or used; the step did not run."""


class LockTimeout(PglockError):
    """The lock was not obtained within the allowed time."""


class LockLost(PglockError):
    """The lock is no longer held by this session."""


def lost_during_step(label: str, reason: str, task: str | None = None) -> str:
    """Return the one text of a LockLost for a lock lost while a step ran under it.

    The same words whoever found the loss (the monitor, the body, a transaction,
    the release) and under every pool: the lock, why, and what to do.
    """
    who = f"task {task}: " if task else ""
    return (
        f"{who}lock {label} was lost during the step: {reason.rstrip('.')}. What to do: "
        "let the step run again (a later call takes the lock afresh); if losses recur, "
        "find what ends the lock sessions (restarts, pg_terminate_backend, the network; "
        "docs: Operations, Loss detection)"
    )


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
