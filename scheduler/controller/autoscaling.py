"""How many instances a model version should have, from what its queue says.

Per model version, from Redis every second: the backlog (entries not yet answered), the age
of the oldest one, and the answers per second of each instance over the last seconds. The
rule, within the model's minimum and maximum:

- **Scale from zero** at once when requests wait and no instance runs.
- **Panic**: the oldest request is older than half the latency objective: double (at least
  one more), without waiting.
- **Up**: the backlog would take more than half the objective to drain at the measured
  rate: as many instances as drain it within that, at once.
- **Down**, cautiously: only after the backlog stayed empty and the instances stayed at most
  half busy for a whole stabilisation window, and by at most half per step; to zero only
  when the minimum is zero.

The policy comes from the model's ``config.pbtxt`` parameters (``sluice.min_instances``,
``sluice.max_instances``, ``sluice.latency_objective_ms``, ``sluice.scale_down_window_s``);
a model without
``sluice.max_instances`` keeps its configured instance count (no autoscaling).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from sluice.core.config import ModelConfig
from sluice.core.errors import InvalidConfig

MIN_KEY, MAX_KEY, OBJECTIVE_KEY, WINDOW_KEY = (
    "sluice.min_instances",
    "sluice.max_instances",
    "sluice.latency_objective_ms",
    "sluice.scale_down_window_s",
)
DEFAULT_OBJECTIVE_S = 1.0
OBJECTIVE_RANGE_MS = (1, 86_400_000)
"""From a millisecond to a day: beyond, the drain-time rule's numbers overflow."""
DOWN_WINDOW_S = 30.0
"""How long a model must stay idle before it loses instances."""


@dataclass(frozen=True)
class ScalePolicy:
    min_instances: int
    max_instances: int
    objective_s: float
    down_window_s: float = DOWN_WINDOW_S

    @classmethod
    def from_config(cls, config: ModelConfig) -> ScalePolicy | None:
        """The model's policy; None when it does not autoscale."""
        parameters = config.parameters
        if MAX_KEY not in parameters:
            return None
        if config.sequence_batching is not None:
            raise InvalidConfig(
                f"model '{config.name}': a sequence model keeps its configured instance count "
                f"(each instance holds the sequences routed to it); remove {MAX_KEY}"
            )
        try:
            maximum = int(parameters[MAX_KEY])
            minimum = int(parameters.get(MIN_KEY, 1))
            objective_ms = float(parameters.get(OBJECTIVE_KEY, DEFAULT_OBJECTIVE_S * 1000))
            window_s = float(parameters.get(WINDOW_KEY, DOWN_WINDOW_S))
        except ValueError as exc:
            raise InvalidConfig(f"model '{config.name}': autoscaling parameters: {exc}") from None
        if (
            not 0 <= minimum <= maximum
            or maximum < 1
            or maximum > 256
            or not OBJECTIVE_RANGE_MS[0] <= objective_ms <= OBJECTIVE_RANGE_MS[1]
            or not 0 <= window_s <= 86400
        ):
            raise InvalidConfig(
                f"model '{config.name}': {MIN_KEY} {minimum} and {MAX_KEY} {maximum} must satisfy "
                f"0 <= min <= max (1..256), {OBJECTIVE_KEY} must be within "
                f"{OBJECTIVE_RANGE_MS[0]}..{OBJECTIVE_RANGE_MS[1]} and "
                f"{WINDOW_KEY} within 0..86400"
            )
        return cls(minimum, maximum, objective_ms / 1000, window_s)


@dataclass(frozen=True)
class Signals:
    backlog: int
    """Entries not yet answered (waiting and being computed)."""
    busy: int
    """Entries delivered to workers and not yet answered."""
    oldest_age_s: float
    answered_per_s: float
    """Answers per second over the last seconds, all instances together."""


@dataclass
class Scaler:
    """The decision for one model version, with the memory a cautious scale-down needs."""

    policy: ScalePolicy
    _idle_since: float | None = None
    _per_instance: deque[float] = field(default_factory=lambda: deque(maxlen=30))

    def target(self, current: int, signals: Signals, now: float) -> int:
        policy = self.policy
        if current and signals.answered_per_s > 0:
            self._per_instance.append(signals.answered_per_s / current)
        wanted = current
        if signals.backlog and current == 0:
            wanted = max(1, policy.min_instances)
        elif signals.oldest_age_s > policy.objective_s / 2:
            wanted = max(current * 2, current + 1)
        elif signals.backlog and self._per_instance:
            rate = max(self._per_instance)  # the best one instance was seen to do
            wanted = max(current, math.ceil(signals.backlog / (rate * policy.objective_s / 2)))
        quiet = signals.backlog <= signals.busy and signals.busy * 2 <= current
        if wanted > current or not quiet:
            self._idle_since = None
        elif self._idle_since is None:
            self._idle_since = now
        elif now - self._idle_since >= policy.down_window_s and current > policy.min_instances:
            half = math.ceil(current / 2) if current > 1 else 0
            wanted = max(half, signals.busy, 1 if signals.backlog else 0)
            self._idle_since = now
        return max(policy.min_instances, min(policy.max_instances, wanted))
