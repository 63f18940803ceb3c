"""Checks Triton applies to a ModelConfig before loading a model."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sluice.core.datatypes import from_config_type
from sluice.core.errors import InvalidConfig

from ._schema import model_config_pb2
from .ensemble import ensemble_problem
from .paths import inside_path_problem, plain_name_problem
from .ragged import ragged_problem
from .sequence import sequence_batching_problem


def validate_config(msg: Any, *, model_name: str, source: str) -> None:
    """Raise :class:`InvalidConfig` naming the first offending field."""

    def fail(reason: str) -> InvalidConfig:
        return InvalidConfig(f"{source}: {reason}")

    if msg.name and msg.name != model_name:
        raise fail(f"name '{msg.name}' does not match the model directory '{model_name}'")
    if msg.max_batch_size < 0:
        raise fail(f"max_batch_size must be >= 0, got {msg.max_batch_size}")
    for kind, tensors in (("input", msg.input), ("output", msg.output)):
        seen: set[str] = set()
        for index, tensor in enumerate(tensors):
            reason = _tensor_problem(tensor)
            label = f"{kind} '{tensor.name}'" if tensor.name else f"{kind} #{index}"
            if reason:
                raise fail(f"{label}: {reason}")
            if tensor.name in seen:
                raise fail(f"{label}: duplicate {kind} name")
            seen.add(tensor.name)
            if kind == "output" and tensor.label_filename:
                reason = inside_path_problem(tensor.label_filename)
                if reason:
                    raise fail(f"{label}: label_filename {tensor.label_filename!r} {reason}")
    if msg.default_model_filename:
        reason = plain_name_problem(msg.default_model_filename)
        if reason:
            raise fail(
                f"default_model_filename {msg.default_model_filename!r} {reason}: it names a "
                "file of each version folder"
            )
    if msg.HasField("dynamic_batching"):
        reason = _dynamic_batching_problem(msg.dynamic_batching, msg.max_batch_size)
        if reason:
            raise fail(f"dynamic_batching: {reason}")
    if msg.HasField("sequence_batching"):
        reason = sequence_batching_problem(msg)
        if reason:
            raise fail(f"sequence_batching: {reason}")
    for index, group in enumerate(msg.instance_group):
        reason = _instance_group_problem(group)
        if reason:
            label = f"'{group.name}'" if group.name else f"#{index}"
            raise fail(f"instance_group {label}: {reason}")
    reason = _version_policy_problem(msg.version_policy)
    if reason:
        raise fail(f"version_policy: {reason}")
    reason = ensemble_problem(msg)
    if reason:
        raise fail(reason)
    reason = ragged_problem(msg)
    if reason:
        raise fail(reason)
    for index, sample in enumerate(msg.model_warmup):
        reason = _warmup_problem(sample, msg.max_batch_size)
        if reason:
            label = f"'{sample.name}'" if sample.name else f"#{index}"
            raise fail(f"model_warmup {label}: {reason}")


def _tensor_problem(tensor: Any) -> str | None:
    if not tensor.name:
        return "name must not be empty"
    if tensor.data_type == 0:
        return "data_type must be set (TYPE_INVALID is not allowed)"
    try:
        from_config_type(model_config_pb2().DataType.Name(tensor.data_type))
    except ValueError:
        return f"unsupported data_type {tensor.data_type}"
    dims = list(tensor.dims)
    if not dims:
        return "dims must not be empty"
    if any(d < 1 and d != -1 for d in dims):
        return f"dims {dims}: each dimension must be >= 1, or -1 for a variable size"
    if tensor.HasField("reshape"):
        return _reshape_problem(dims, list(tensor.reshape.shape))
    return None


def _reshape_problem(dims: Sequence[int], shape: Sequence[int]) -> str | None:
    if any(d < 1 and d != -1 for d in shape):
        return f"reshape {list(shape)}: each dimension must be >= 1, or -1 for a variable size"
    if not shape:
        # An empty reshape is a scalar: dims must then hold exactly one element.
        if -1 in dims or _element_count(dims) != 1:
            return f"reshape []: dims {list(dims)} must have exactly one element"
        return None
    dims_chunks, shape_chunks = _chunks(dims), _chunks(shape)
    if len(dims_chunks) != len(shape_chunks):
        return (
            f"dims {list(dims)} and reshape {list(shape)} have different numbers of "
            "variable-size dimensions"
        )
    if dims_chunks != shape_chunks:
        return f"dims {list(dims)} and reshape {list(shape)} have different element counts"
    return None


def _chunks(dims: Sequence[int]) -> list[int]:
    """Element counts of the runs of fixed dims separated by -1 (Triton's rule)."""
    chunks, current = [], 1
    for dim in dims:
        if dim == -1:
            chunks.append(current)
            current = 1
        else:
            current *= dim
    chunks.append(current)
    return chunks


def _element_count(dims: Sequence[int]) -> int:
    count = 1
    for dim in dims:
        count *= dim
    return count


def _dynamic_batching_problem(batching: Any, max_batch_size: int) -> str | None:
    if max_batch_size == 0:
        return "requires max_batch_size > 0 (a model with max_batch_size 0 cannot batch)"
    for size in batching.preferred_batch_size:
        if size < 1 or size > max_batch_size:
            return (
                f"preferred_batch_size {size} must be between 1 and max_batch_size {max_batch_size}"
            )
    levels = batching.priority_levels
    if levels > 0 and not 1 <= batching.default_priority_level <= levels:
        return (
            f"default_priority_level {batching.default_priority_level} must be in "
            f"[1, {levels}] (priority_levels)"
        )
    for level in batching.priority_queue_policy:
        if not 1 <= level <= levels:
            return f"priority_queue_policy level {level} must be in [1, {levels}]"
    return None


def _instance_group_problem(group: Any) -> str | None:
    if group.count < 0:
        return f"count must be >= 0, got {group.count}"
    if any(gpu < 0 for gpu in group.gpus):
        return f"gpus {list(group.gpus)} must be >= 0"
    kind = model_config_pb2().ModelInstanceGroup.Kind.Name(group.kind)
    if kind == "KIND_CPU" and group.gpus:
        return "kind KIND_CPU cannot list gpus"
    names = [resource.name for resource in group.rate_limiter.resources]
    if any(not name for name in names):
        return "rate_limiter: a resource's name must not be empty"
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        return f"rate_limiter: resource '{repeated[0]}' is listed more than once"
    return None


def _version_policy_problem(policy: Any) -> str | None:
    which = policy.WhichOneof("policy_choice")
    if which == "latest" and policy.latest.num_versions < 1:
        return "latest.num_versions must be >= 1"
    if which == "specific":
        versions = list(policy.specific.versions)
        if not versions:
            return "specific.versions must not be empty"
        if any(v < 1 for v in versions):
            return f"specific.versions {versions} must all be >= 1"
    return None


def _warmup_problem(sample: Any, max_batch_size: int) -> str | None:
    if not sample.name:
        return "name must not be empty"
    if max_batch_size > 0 and sample.batch_size > max_batch_size:
        return f"batch_size {sample.batch_size} exceeds max_batch_size {max_batch_size}"
    if max_batch_size == 0 and sample.batch_size > 1:
        return (
            f"batch_size {sample.batch_size}: a model with max_batch_size 0 has no batch "
            "dimension (use batch_size 1)"
        )
    if sample.count < 0:
        return f"count must be >= 0, got {sample.count}"
    if not sample.inputs:
        return "inputs must not be empty"
    for name, spec in sample.inputs.items():
        reason = _warmup_input_problem(spec)
        if reason:
            return f"input '{name}': {reason}"
    return None


def _warmup_input_problem(spec: Any) -> str | None:
    if spec.data_type == 0:
        return "data_type must be set (TYPE_INVALID is not allowed)"
    try:
        from_config_type(model_config_pb2().DataType.Name(spec.data_type))
    except ValueError:
        return f"unsupported data_type {spec.data_type}"
    if any(d < 1 for d in spec.dims):
        return f"dims {list(spec.dims)}: warm-up dimensions must be fixed sizes >= 1"
    source = spec.WhichOneof("input_data_type")
    if source is None:
        return "set one of zero_data, random_data or input_data_file"
    if source == "input_data_file" and inside_path_problem(spec.input_data_file):
        return (
            f"input_data_file '{spec.input_data_file}' must be a file name inside the "
            "model's warmup/ folder"
        )
    return None
