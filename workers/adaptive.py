"""When to close a batch: adaptive batching within Triton's ``max_queue_delay_microseconds``.

Triton's window is an upper bound: a batch may go before it ends. A worker that waits the
whole window for every batch makes a lone request pay the window for nothing, while one
that never waits pays a batch's fixed cost for every request when traffic is heavy. So the
worker learns two things online: what a batch costs by its size (:class:`CostModel`) and
how fast items arrive (:class:`ArrivalRate`); and it keeps a batch open only while waiting
pays (:class:`BatchPolicy`).

The rule. With ``n`` items held, a batch cost ``c(k) = a + b*k`` and items arriving at
``λ`` per second, waiting a short ``Δ`` more adds ``λΔ`` items to this batch instead of
the next one. Summing the completion times of those requests and the ones held (each
arrival spared a fixed cost ``a`` it would pay in a batch of its own, each held request
delayed by ``Δ``, each new item adding ``b`` to the held requests' batch), the wait pays
while ``n * (1 + λb) < λa``: the items expected during one fixed cost outnumber those
already held. Light traffic (``λa`` well under 1) therefore sends a lone request at once,
and heavy traffic fills batches toward ``λa / (1 + λb)``. The window still bounds every
wait, a full batch or a preferred size still closes it, and nothing closes while the
previous batch computes (the batch only grows meanwhile).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from sluice.core.config import ModelConfig
from sluice.workers.backends.threads import flag_parameter

ADAPTIVE_PARAMETER = "adaptive_batching"
"""The config.pbtxt ``parameters`` key that turns adaptive batching off ("false"): the
batch then waits the whole ``max_queue_delay_microseconds``, as Triton's does."""

_CLIP_SCALES = 4.0
"""Residuals beyond this many mean absolute residuals are clipped (a batch that a garbage
collection or a noisy neighbour slowed down moves the fit by a bounded amount)."""
_WARM_BATCHES = 8
"""Batches observed before the model predicts from its own fit."""


@dataclass
class CostModel:
    """Seconds one batch of ``k`` items keeps the instance busy, ``a + b*k``, fitted by
    exponentially weighted least squares over recent batches (``half_life`` batches), with
    outliers clipped. Both terms are kept non-negative."""

    half_life: float = 64.0
    initial_s: float = 0.001
    _decay: float = field(init=False)
    _weights: list[float] = field(default_factory=lambda: [0.0] * 5)
    """Decayed sums of 1, k, y, k², k·y."""
    _abs_residual: float = 0.0
    observed: int = 0

    def __post_init__(self) -> None:
        self._decay = 0.5 ** (1.0 / self.half_life)

    def fit(self) -> tuple[float, float]:
        """(fixed seconds per batch, seconds per item)."""
        s0, sk, sy, skk, sky = self._weights
        if s0 <= 0:
            return self.initial_s, 0.0
        mean_k, mean_y = sk / s0, sy / s0
        spread = skk / s0 - mean_k * mean_k
        if spread <= 1e-9 * max(1.0, mean_k * mean_k):
            # One batch size seen so far: it cannot be split into fixed and per-item parts.
            # Counting it all as fixed favours waiting only when arrivals are dense enough.
            return max(mean_y, 0.0), 0.0
        per_item = (sky / s0 - mean_k * mean_y) / spread
        fixed = mean_y - per_item * mean_k
        if per_item < 0:
            return max(mean_y, 0.0), 0.0
        if fixed < 0:
            return 0.0, max(sky / skk, 0.0)
        return fixed, per_item

    def predict(self, items: int) -> float:
        fixed, per_item = self.fit()
        return fixed + per_item * items

    def observe(self, items: int, seconds: float) -> None:
        if not (seconds >= 0 and math.isfinite(seconds)) or items < 1:
            return
        if self.observed >= _WARM_BATCHES:
            predicted = self.predict(items)
            residual = seconds - predicted
            bound = _CLIP_SCALES * self._abs_residual
            if bound > 0 and abs(residual) > bound:
                residual = math.copysign(bound, residual)
                seconds = predicted + residual
            self._abs_residual += (1 - self._decay) * (abs(residual) - self._abs_residual)
        elif self.observed:
            self._abs_residual = abs(seconds - self.predict(items))
        d = self._decay
        k = float(items)
        for index, value in enumerate((1.0, k, seconds, k * k, k * seconds)):
            self._weights[index] = self._weights[index] * d + value
        self.observed += 1

    @property
    def warm(self) -> bool:
        return self.observed >= _WARM_BATCHES


@dataclass
class ArrivalRate:
    """Items per second arriving at this worker, exponentially decayed over ``horizon_s``.

    Items are counted when read: those read in one burst arrived since the previous read,
    so the average over the horizon is right even when reads are sparse. With no arrivals
    the rate decays toward 0 by itself."""

    horizon_s: float = 0.2
    _level: float = 0.0
    _at: float | None = None
    _since: float | None = None

    def add(self, items: int, now: float) -> None:
        if self._at is None:
            self._at = self._since = now
        self._level = self._decayed(now) + items
        self._at = now

    def per_second(self, now: float) -> float:
        if self._at is None or self._since is None:
            return 0.0
        # Until one horizon has passed, the time observed so far is the denominator.
        span = min(self.horizon_s, max(now - self._since, 1e-3))
        return self._decayed(now) / span

    def _decayed(self, now: float) -> float:
        if self._at is None:
            return 0.0
        return self._level * math.exp(-max(0.0, now - self._at) / self.horizon_s)


@dataclass
class BatchPolicy:
    """Whether a batch of ``items`` that has waited ``waited_s`` should go now."""

    window_s: float
    adaptive: bool
    cost: CostModel = field(default_factory=CostModel)
    arrivals: ArrivalRate = field(default_factory=ArrivalRate)

    def target(self, now: float) -> float:
        """The batch size that waiting is worth reaching: ``λa / (1 + λb)``."""
        rate = self.arrivals.per_second(now)
        fixed, per_item = self.cost.fit()
        return rate * fixed / (1.0 + rate * per_item)

    def close(self, items: int, waited_s: float, now: float) -> str | None:
        """Why the batch closes now (``window``, ``adaptive``), or None to keep waiting."""
        if waited_s >= self.window_s:
            return "window"
        if self.adaptive and items >= self.target(now):
            return "adaptive"
        return None


def batch_policy(config: ModelConfig) -> BatchPolicy:
    """The policy a model's config asks for (adaptive unless its parameters turn it off)."""
    dynamic = config.dynamic_batching
    window_s = dynamic.max_queue_delay_us / 1e6 if dynamic else 0.0
    adaptive = flag_parameter(config.name, config.parameters, ADAPTIVE_PARAMETER)
    return BatchPolicy(window_s, adaptive is not False)
