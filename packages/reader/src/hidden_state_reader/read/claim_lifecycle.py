"""One claim's life, from taking it to settling it, in one place.

A reader that shares its source with other readers (``claim=True``) claims a sample
before it reads it, so that one reader of the group delivers it: the directory backend
when it decides about the sample (``decision``, with ``claims.ClaimStore``), the store
backend when a commit record names it (``store.backend``, with ``store.claims``). Both
hand out a ``HeldClaim``; whatever then becomes of the sample, its claim is settled
exactly once, by ``settle``, with how its sample ended:

================  ===================================================  ===========
``Ending``        when                                                 the claim
================  ===================================================  ===========
``CONSUMED``      delivered to the caller, or rejected (and reported)  ``done``
``GONE``          consumed and its data removed, or it vanished        ``remove``
``RETURNED``      not ready after all, or looking at it failed         ``abandon``
================  ===================================================  ===========

``done`` records that the group is finished with the sample (no reader of the group
gets it again); ``remove`` drops the claim of a sample that no longer exists;
``abandon`` gives the sample back, so this or another reader takes it later.
"""

from __future__ import annotations

import enum
from typing import Protocol


class HeldClaim(Protocol):
    """A reader's claim on one sample (``claims.Claim``, ``store.claims.StoreClaim``).

    Attributes:
        reclaimed: Taken over from a reader that died (``ReaderStats.reclaimed``).
    """

    reclaimed: bool

    def done(self) -> None:
        """The group consumed the sample (idempotent)."""

    def remove(self) -> None:
        """The sample is gone: drop the claim."""

    def abandon(self) -> None:
        """Give the sample back to the group."""


class Ending(enum.Enum):
    """How a claimed sample ended (see the module docstring)."""

    CONSUMED = "consumed"
    GONE = "gone"
    RETURNED = "returned"


def settle(claim: HeldClaim | None, ending: Ending) -> None:
    """Settle ``claim`` (None: the reader does not claim) for how its sample ended."""
    if claim is None:
        return
    if ending is Ending.CONSUMED:
        claim.done()
    elif ending is Ending.GONE:
        claim.remove()
    else:
        claim.abandon()
