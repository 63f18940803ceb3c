"""What an ensemble's request runs and how its tensors cross between batching and
non-batching models, as Triton's ensemble scheduler decides.

- :func:`live_steps`: only the steps that lead to a requested output run. A step is left
  out when every tensor it writes is unneeded: an ensemble output not requested, or an
  intermediate tensor every reader of which is left out. (A step writing a tensor that
  nothing reads and that is no ensemble output still runs, as in Triton.)
- :func:`fit_shape`: a tensor made without a batch dimension (by a non-batching model, or
  the request of a non-batching ensemble) gains a batch dimension of 1 before a batching
  model reads it, when its shape is the reader's configured shape; a tensor with a batch
  dimension of 1 loses it before a non-batching reader (or the ensemble's output) whose
  configured shape it does not match otherwise. Anything else passes unchanged.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import numpy as np

from sluice.core.config import ModelConfig


@dataclass(frozen=True, slots=True)
class Carried:
    """An ensemble tensor of one request."""

    array: np.ndarray | None
    """None: the model meant to make it did not (or an optional input not given)."""
    batch: int
    """Its batch dimension as its maker had it; 0: made without one."""


def live_steps(config: ModelConfig, requested: Collection[str]) -> frozenset[int]:
    """The indexes of the steps of ensemble ``config`` that a request for ``requested``
    outputs runs (all of them when every output is requested)."""
    steps = config.ensemble_steps
    everything = frozenset(range(len(steps)))
    outputs = {spec.name for spec in config.outputs}
    if outputs <= set(requested):
        return everything
    readers: dict[str, set[int]] = {}
    for index, step in enumerate(steps):
        for tensor in step.input_map.values():
            readers.setdefault(tensor, set()).add(index)
    live = set(everything)

    def unneeded(tensor: str) -> bool:
        if tensor in requested:
            return False
        reading = readers.get(tensor, set())
        if not reading and tensor not in outputs:
            return False  # read by nothing, and no output: Triton keeps its writer
        return not reading & live

    changed = True
    while changed:
        changed = False
        for index in sorted(live):
            written = steps[index].output_map.values()
            if written and all(unneeded(tensor) for tensor in written):
                live.discard(index)
                changed = True
    return frozenset(live)


def dims_match(config_dims: Sequence[int], shape: Sequence[int]) -> bool:
    """Whether ``shape`` is ``config_dims`` (where either says -1, any size matches)."""
    if len(config_dims) != len(shape):
        return False
    return all(a == -1 or b == -1 or a == b for a, b in zip(config_dims, shape, strict=True))


def fit_shape(
    config_dims: Sequence[int], batching: bool, batch_size: int, shape: tuple[int, ...]
) -> tuple[int, ...]:
    """The shape a tensor of ``shape`` takes for a reader configured with ``config_dims``
    that batches (``batching``) or not. ``batch_size``: the tensor's batch dimension as its
    maker had it (0: made without one)."""
    if batching == (batch_size != 0):
        return shape
    if batching:
        return (1, *shape) if dims_match(config_dims, shape) else shape
    if batch_size == 1 and not dims_match(config_dims, shape):
        return shape[1:]
    return shape
