"""Triton's ``response_stats`` for decoupled models: per response index, how long each
response took to make (``compute_infer``: since the request's previous response, or since
its compute began) and to send (``compute_output``), and how it ended (``success``,
``fail``, ``empty_response``: the final flag alone, ``cancel``).

The worker counts a batch's responses here while the model streams, and adds them to the
model version's statistics hash with the batch's other counters
(:func:`sluice.core.observability.statistics.response_field`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from sluice.core.observability import statistics as st


@dataclass(slots=True)
class ResponseTally:
    """One batch's responses, as counters of the statistics hash."""

    counters: dict[str, int] = field(default_factory=dict)

    def add(self, index: int, outcome: str, made_ns: int, sent_ns: int) -> None:
        """Response ``index`` of a request ended as ``outcome`` (one of
        :data:`sluice.core.observability.statistics.RESPONSE_OUTCOMES`), after ``made_ns`` of
        compute and ``sent_ns`` of sending. Indexes past
        :data:`~sluice.core.observability.statistics.MAX_RESPONSE_INDEX` are not counted (a
        hash field per index must stay bounded)."""
        if index > st.MAX_RESPONSE_INDEX:
            return
        for kind, ns in (
            ("compute_infer", made_ns),
            ("compute_output", sent_ns),
            (outcome, made_ns + sent_ns),
        ):
            self._add(st.response_field(index, kind, "count"), 1)
            self._add(st.response_field(index, kind, "ns"), ns)

    def _add(self, name: str, amount: int) -> None:
        self.counters[name] = self.counters.get(name, 0) + amount


@dataclass(slots=True)
class RequestClock:
    """When a request's previous response went (its compute's start before the first)."""

    since_ns: int = field(default_factory=time.perf_counter_ns)

    def lap(self, made_at_ns: int) -> tuple[int, int]:
        """(made, sent) for the response made at ``made_at_ns`` and sent now."""
        now = time.perf_counter_ns()
        made, sent = max(0, made_at_ns - self.since_ns), max(0, now - made_at_ns)
        self.since_ns = now
        return made, sent
