"""A lost lock as a value: what kind of loss, and the detail for people.

Where a loss is found (a check, a release, the leader fence, a holder's
transaction) it is described once, as a :class:`Loss`; everything after that
(ending the session, telling the holder, failing a shared session's other
holds) decides on its :class:`LossKind`, never on the words of its detail,
which may be reworded freely.
"""

from __future__ import annotations

import dataclasses
import enum


class LossKind(enum.Enum):
    """Why a held lock is no longer a lock."""

    #: The lock session ended (the server ended it, a restart, a failed socket): every
    #: lock on it went with it.
    SESSION_ENDED = "session ended"
    #: The session lives on, but no longer holds this lock (its own SQL unlocked it).
    LOCK_GONE = "lock gone"
    #: The session's server is not (or no longer) the leader of its cluster.
    NOT_LEADER = "not the leader"
    #: Nobody can say whether the lock is held (the server or the leader source does
    #: not answer in time): it is treated as lost, as failing closed requires.
    CANNOT_TELL = "cannot tell"


@dataclasses.dataclass(frozen=True)
class Loss:
    """One loss: its kind (what the library acts on) and its detail (what people read)."""

    kind: LossKind
    detail: str

    def __str__(self) -> str:
        return self.detail

    @property
    def takes_the_session(self) -> bool:
        """Whether every lock on the session is lost with this one.

        Only a lock gone from a live session is that lock's alone; a session that
        ended, or a server that may not lead (or cannot be asked), takes them all.
        """
        return self.kind is not LossKind.LOCK_GONE


def session_ended(detail: str) -> Loss:
    return Loss(LossKind.SESSION_ENDED, detail)


def lock_gone(detail: str) -> Loss:
    return Loss(LossKind.LOCK_GONE, detail)
