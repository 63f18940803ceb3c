"""The typed, immutable view of a model configuration used by every process."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from .ragged import BatchInput, BatchOutput
from .sequence import SequenceBatching


class FrozenMap(Mapping[str, str]):
    """A read-only, hashable string mapping (keeps :class:`ModelConfig` hashable)."""

    __slots__ = ("_data",)

    def __init__(self, data: Mapping[str, str] | None = None) -> None:
        self._data: dict[str, str] = dict(data or {})

    def __getitem__(self, key: str) -> str:
        return self._data[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __hash__(self) -> int:
        return hash(frozenset(self._data.items()))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Mapping):
            return self._data == dict(other.items())
        return NotImplemented

    def __repr__(self) -> str:
        return f"FrozenMap({self._data!r})"


@dataclass(frozen=True, slots=True)
class TensorSpec:
    name: str
    datatype: str
    dims: tuple[int, ...]
    reshape: tuple[int, ...] | None = None
    optional: bool = False
    label_filename: str = ""
    """Outputs only: labels for classification, one per line, in the model directory."""
    allow_ragged_batch: bool = False
    """Inputs only: requests of any shapes batch together, the model receiving their
    elements concatenated (:mod:`sluice.core.config.ragged`)."""


@dataclass(frozen=True, slots=True)
class DynamicBatching:
    preferred_batch_sizes: tuple[int, ...] = ()
    max_queue_delay_us: int = 0
    preserve_ordering: bool = False
    priority_levels: int = 0
    default_priority_level: int = 0
    max_queue_size: int = 0
    default_timeout_us: int = 0
    allow_timeout_override: bool = False
    timeout_action: str = "REJECT"


@dataclass(frozen=True, slots=True)
class RateLimiterResource:
    """A resource an instance needs to execute under Triton's rate limiter."""

    name: str
    count: int
    global_: bool = False
    """One pool for the whole deployment; otherwise one per device of each host."""


@dataclass(frozen=True, slots=True)
class RateLimiter:
    """An instance group's ``rate_limiter``: what each of its instances needs to execute
    (``--rate-limit=execution_count``), and its priority among the instances that wait."""

    resources: tuple[RateLimiterResource, ...] = ()
    priority: int = 0


@dataclass(frozen=True, slots=True)
class InstanceGroup:
    name: str
    count: int
    kind: str
    gpus: tuple[int, ...] = ()
    rate_limiter: RateLimiter | None = None


@dataclass(frozen=True, slots=True)
class VersionPolicy:
    kind: str = "latest"
    num_versions: int = 1
    versions: tuple[int, ...] = ()

    def select(self, available: Iterable[int]) -> tuple[int, ...]:
        """The versions to serve among ``available``, ascending."""
        present = sorted(set(available))
        if self.kind == "all":
            return tuple(present)
        if self.kind == "specific":
            wanted = set(self.versions)
            return tuple(v for v in present if v in wanted)
        return tuple(present[-self.num_versions :]) if self.num_versions > 0 else ()


@dataclass(frozen=True, slots=True)
class WarmupInput:
    """One input of a warm-up sample: ``dims`` is the shape of one batch item."""

    name: str
    datatype: str
    dims: tuple[int, ...]
    source: str
    """"zero", "random" or "file"."""
    file: str = ""
    """For "file": a path relative to ``<model>/warmup/``."""


@dataclass(frozen=True, slots=True)
class WarmupSample:
    """One ``model_warmup`` entry: run ``count`` times (at least once) at ``batch_size``."""

    name: str
    batch_size: int
    inputs: tuple[WarmupInput, ...]
    count: int = 1


@dataclass(frozen=True, slots=True)
class EnsembleStep:
    """One ``ensemble_scheduling.step``: a composing model and how its tensors are wired."""

    model_name: str
    model_version: int
    """-1: the latest ready version when the step runs."""
    input_map: FrozenMap
    """The step model's input -> the ensemble tensor it reads."""
    output_map: FrozenMap
    """The step model's output -> the ensemble tensor it produces."""


ENSEMBLE_PLATFORM = "ensemble"


@dataclass(frozen=True, slots=True)
class ModelConfig:
    name: str
    platform: str
    backend: str
    max_batch_size: int
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    version_policy: VersionPolicy
    instance_groups: tuple[InstanceGroup, ...]
    dynamic_batching: DynamicBatching | None
    parameters: Mapping[str, str]
    default_model_filename: str
    execution_accelerators: tuple[str, ...] = ()
    warmup: tuple[WarmupSample, ...] = ()
    sequence_batching: SequenceBatching | None = None
    ensemble_steps: tuple[EnsembleStep, ...] = ()
    """``ensemble_scheduling.step``, in config order (empty unless an ensemble)."""
    batch_inputs: tuple[BatchInput, ...] = ()
    """Inputs the server makes for each batch (ragged batching)."""
    batch_outputs: tuple[BatchOutput, ...] = ()
    """Outputs scattered back by an input's shapes (ragged batching)."""
    ragged_inputs: frozenset[str] = frozenset()
    """The inputs with ``allow_ragged_batch`` (of a model that batches)."""
    raw: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def input(self, name: str) -> TensorSpec | None:
        return next((spec for spec in self.inputs if spec.name == name), None)

    def output(self, name: str) -> TensorSpec | None:
        return next((spec for spec in self.outputs if spec.name == name), None)

    @property
    def total_instances(self) -> int:
        if not self.instance_groups:
            return 1
        return sum(group.count for group in self.instance_groups)

    @property
    def is_ensemble(self) -> bool:
        return self.platform == ENSEMBLE_PLATFORM

    @property
    def decoupled(self) -> bool:
        """``model_transaction_policy { decoupled: true }``: any number of responses per
        request, the last one marked final."""
        policy = self.raw.get("model_transaction_policy") or {}
        return bool(policy.get("decoupled", False))

    @property
    def response_cache(self) -> bool:
        """``response_cache { enable: true }``: identical requests may be answered from the
        response cache (where the deployment has one)."""
        cache = self.raw.get("response_cache") or {}
        return bool(cache.get("enable", False))

    @property
    def platform_or_backend(self) -> str:
        return self.platform or self.backend
