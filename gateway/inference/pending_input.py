"""An input between the parsing steps (see :mod:`sluice.gateway.inference.parsing`): its header
passed the structural checks, its data is not read yet."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sluice.core.config import TensorSpec


@dataclass(frozen=True, slots=True)
class ShmParameters:
    region: str
    offset: int
    byte_size: int


@dataclass(slots=True)
class PendingInput:
    """An input whose header passed the structural checks; data not yet read."""

    label: str
    name: str
    datatype: str
    shape: tuple[int, ...]
    data: Any  # the JSON `data` value, or None for binary inputs
    binary_size: int | None
    shm: ShmParameters | None = None
    spec: TensorSpec | None = None
    count: int = 0
