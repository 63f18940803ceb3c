"""A bound on the request-body bytes one gateway process holds at once.

Each inference body may be as large as ``SLUICE_MAX_BODY_BYTES`` and is held until its
answer is sent (tensors are slices of it), so without a bound a few thousand large
requests at once would take more memory than the host has and the gateway would be
killed. Bytes are reserved as they arrive (at once for a declared ``Content-Length``):
past the budget a request gets 503 with ``Retry-After``, and others go on.
"""

from __future__ import annotations

from dataclasses import dataclass

from sluice.core.errors import ServerBusy


@dataclass
class BodyBudget:
    limit: int
    held: int = 0
    refused: int = 0
    """Requests refused for lack of room since the metrics last took the count."""

    def reservation(self) -> BodyReservation:
        return BodyReservation(self)


class BodyReservation:
    """The bytes one request holds; grown with :meth:`ensure`, returned by :meth:`release`."""

    __slots__ = ("budget", "size")

    def __init__(self, budget: BodyBudget) -> None:
        self.budget = budget
        self.size = 0

    def ensure(self, size: int) -> None:
        """Hold at least ``size`` bytes; 503 when the process's budget cannot take them."""
        more = size - self.size
        if more <= 0:
            return
        budget = self.budget
        if budget.held + more > budget.limit:
            budget.refused += 1
            raise ServerBusy(
                f"the gateway holds {budget.held} bytes of request bodies, and "
                f"{more} more would pass its limit of {budget.limit} "
                "(SLUICE_MAX_BUFFERED_BODY_BYTES); retry later",
                1,
            )
        budget.held += more
        self.size = size

    def release(self) -> None:
        self.budget.held -= self.size
        self.size = 0
