"""Admission control: refuse work before it is queued, at constant cost.

Two bounds. Per model version, the queue depth (the larger of this gateway's
own requests and the entries in its streams, read from Redis in the background) may not pass
the model's ``max_queue_size``: 503 with Triton's text (core ``PolicyQueue::Enqueue``:
"[request id: <id>] Exceeds maximum queue size"). Per gateway process, the requests held
at once may not pass ``max_in_flight``: 503. Both answers carry Retry-After.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from sluice.core.errors import Overloaded, ServerBusy


@dataclass
class Admission:
    max_in_flight: int
    in_flight: int = 0
    per_model: dict[tuple[str, int], int] = field(default_factory=dict)
    observed_depth: dict[tuple[str, int], int] = field(default_factory=dict)
    """Queue depth per model version as last read from Redis (all gateways' requests)."""
    rejected: Counter[tuple[str, int, str]] = field(default_factory=Counter)
    """Requests refused per model version and reason (``ADMISSION_REJECT_REASONS``)
    since the last hand-over to the metrics."""
    arrived: int = 0
    """Requests that asked to be admitted, ever (the catalog refresh slows down while it
    does not move)."""

    @contextmanager
    def admit(
        self, model: str, version: int, max_queue_size: int, request_id: str = ""
    ) -> Iterator[None]:
        key = (model, version)
        self.arrived += 1
        if self.in_flight >= self.max_in_flight:
            self.rejected[(model, version, "in_flight")] += 1
            raise ServerBusy(
                f"the gateway holds {self.in_flight} requests, its limit; retry later", 1
            )
        if max_queue_size:
            depth = max(self.per_model.get(key, 0), self.observed_depth.get(key, 0))
            if depth >= max_queue_size:
                self.rejected[(model, version, "queue_full")] += 1
                raise Overloaded(
                    f"[request id: {request_id or '<id_unknown>'}] Exceeds maximum queue size; "
                    f"model '{model}' version {version} has {depth} queued requests, "
                    f"its max_queue_size is {max_queue_size}; retry later",
                    1,
                )
        self.in_flight += 1
        self.per_model[key] = self.per_model.get(key, 0) + 1
        try:
            yield
        finally:
            self.in_flight -= 1
            self.per_model[key] -= 1

    def observe(self, depths: dict[tuple[str, int], int]) -> None:
        self.observed_depth = depths

    def take_rejected(self) -> Counter[tuple[str, int, str]]:
        """The refusals counted since the last call (then forgotten here)."""
        taken, self.rejected = self.rejected, Counter()
        return taken
