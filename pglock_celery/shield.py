"""Where the library's own code runs inside a body: no interrupt lands there.

A body interrupted by a lost lock (``pglock_on_lost = "interrupt"``, monitor.Body)
gets LockLost raised at the point it has reached. Raised in the middle of the
library's own work (a check, a transaction's proof, a statement being read), it
would leave that work half done. So every entry point a body calls runs inside
:func:`library_code`: an interrupt that comes meanwhile is held back and raised as
the outermost such call returns, where the body called the library.
"""

from __future__ import annotations

from contextvars import ContextVar
from types import TracebackType
from typing import Protocol


class Interruptible(Protocol):
    """What library_code needs of the body running in this context (monitor.Body)."""

    def enter_library(self) -> None: ...

    def leave_library(self) -> None:
        """Leave the library's code; raise the interrupt held back meanwhile, if any."""


#: The body running in this thread or greenlet, set by monitor.Body around it.
running_body: ContextVar[Interruptible | None] = ContextVar("pglock_running_body", default=None)


class library_code:  # used as a function: ``with library_code():``
    """Run a block of the library's code with interrupts held back until it ends."""

    __slots__ = ("_body",)

    def __enter__(self) -> None:
        body = self._body = running_body.get()
        if body is not None:
            body.enter_library()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._body is not None:
            self._body.leave_library()
