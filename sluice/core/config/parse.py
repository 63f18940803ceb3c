"""Building :class:`ModelConfig` from protobuf text, messages and Triton JSON."""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping
from typing import Any

from google.protobuf import json_format, text_format

from sluice.core.datatypes import from_config_type
from sluice.core.errors import InvalidConfig

from ._schema import model_config_pb2, new_model_config
from .model import (
    DynamicBatching,
    EnsembleStep,
    FrozenMap,
    InstanceGroup,
    ModelConfig,
    RateLimiter,
    RateLimiterResource,
    TensorSpec,
    VersionPolicy,
    WarmupInput,
    WarmupSample,
)
from .platforms import default_model_filename
from .ragged import build_batch_inputs, build_batch_outputs, ragged_inputs
from .render import render_config
from .sequence import build_sequence_batching
from .validate import validate_config

CONFIG_FILENAME = "config.pbtxt"
_POSITION = re.compile(r"^(\d+):(\d+) : ")


def parse_config_text(text: str, *, model_name: str, source: str = CONFIG_FILENAME) -> ModelConfig:
    """Parse a ``config.pbtxt`` (protobuf text format) and validate it; errors name the
    file as ``source``."""
    msg = new_model_config()
    try:
        text_format.Parse(text, msg)
    except text_format.ParseError as exc:
        reason = str(exc)
        match = _POSITION.match(reason)
        if match:
            line, column = match.groups()
            reason = f"line {line}, column {column}: {reason[match.end() :]}"
        raise InvalidConfig(f"{source}: {reason}") from None
    return config_from_proto(msg, model_name=model_name, source=source)


def config_from_proto(msg: Any, *, model_name: str, source: str = CONFIG_FILENAME) -> ModelConfig:
    """Validate a ModelConfig message, fill Triton's defaults and build the typed view.

    The input message is not modified. Filling defaults is idempotent, so a
    config rebuilt from its own ``raw`` rendering compares equal.
    """
    normalized = new_model_config()
    normalized.CopyFrom(msg)
    validate_config(normalized, model_name=model_name, source=source)
    _fill_defaults(normalized, model_name)
    return _build(normalized)


def config_to_json(cfg: ModelConfig) -> dict[str, Any]:
    """Triton's JSON rendering of ``cfg`` (what ``/config`` returns); a private copy."""
    return copy.deepcopy(dict(cfg.raw))


def config_from_json(data: Mapping[str, Any], *, model_name: str) -> ModelConfig:
    """Inverse of :func:`config_to_json`."""
    msg = new_model_config()
    try:
        json_format.ParseDict(data, msg)
    except json_format.ParseError as exc:
        raise InvalidConfig(f"config JSON: {exc}") from None
    return config_from_proto(msg, model_name=model_name, source="config JSON")


def config_to_proto(cfg: ModelConfig) -> Any:
    """A fresh ModelConfig message equal to ``cfg`` (for deriving changed configs)."""
    msg = new_model_config()
    json_format.ParseDict(cfg.raw, msg)
    return msg


def _fill_defaults(msg: Any, model_name: str) -> None:
    msg.name = model_name
    if msg.version_policy.WhichOneof("policy_choice") is None:
        msg.version_policy.latest.num_versions = 1
    if not msg.default_model_filename:
        model_type = (
            msg.parameters["model_type"].string_value if "model_type" in msg.parameters else ""
        )
        msg.default_model_filename = default_model_filename(msg.platform, msg.backend, model_type)
    for index, group in enumerate(msg.instance_group):
        if not group.name:
            group.name = f"{model_name}_{index}"
        if group.count == 0:
            group.count = 1


def _rate_limiter(msg: Any) -> RateLimiter:
    return RateLimiter(
        resources=tuple(
            RateLimiterResource(r.name, r.count, getattr(r, "global")) for r in msg.resources
        ),
        priority=msg.priority,
    )


def _build(msg: Any) -> ModelConfig:
    pb2 = model_config_pb2()
    accelerators = msg.optimization.execution_accelerators.gpu_execution_accelerator
    return ModelConfig(
        name=msg.name,
        platform=msg.platform,
        backend=msg.backend,
        max_batch_size=msg.max_batch_size,
        inputs=tuple(
            _tensor(t, optional=t.optional, ragged=t.allow_ragged_batch) for t in msg.input
        ),
        outputs=tuple(
            _tensor(t, optional=False, label_filename=t.label_filename) for t in msg.output
        ),
        version_policy=_version_policy(msg.version_policy),
        instance_groups=tuple(
            InstanceGroup(
                name=g.name,
                count=g.count,
                kind=pb2.ModelInstanceGroup.Kind.Name(g.kind),
                gpus=tuple(g.gpus),
                rate_limiter=_rate_limiter(g.rate_limiter) if g.HasField("rate_limiter") else None,
            )
            for g in msg.instance_group
        ),
        dynamic_batching=(
            _dynamic_batching(msg.dynamic_batching) if msg.HasField("dynamic_batching") else None
        ),
        parameters=FrozenMap({k: v.string_value for k, v in msg.parameters.items()}),
        default_model_filename=msg.default_model_filename,
        execution_accelerators=tuple(a.name for a in accelerators),
        warmup=tuple(_warmup_sample(sample) for sample in msg.model_warmup),
        sequence_batching=(
            build_sequence_batching(msg.sequence_batching)
            if msg.HasField("sequence_batching")
            else None
        ),
        ensemble_steps=tuple(
            EnsembleStep(
                model_name=step.model_name,
                model_version=step.model_version,
                input_map=FrozenMap(dict(step.input_map)),
                output_map=FrozenMap(dict(step.output_map)),
            )
            for step in msg.ensemble_scheduling.step
        ),
        batch_inputs=build_batch_inputs(msg),
        batch_outputs=build_batch_outputs(msg),
        ragged_inputs=ragged_inputs(msg),
        raw=render_config(msg),
    )


def _tensor(
    tensor: Any, *, optional: bool, label_filename: str = "", ragged: bool = False
) -> TensorSpec:
    type_name = model_config_pb2().DataType.Name(tensor.data_type)
    return TensorSpec(
        name=tensor.name,
        datatype=from_config_type(type_name),
        dims=tuple(tensor.dims),
        reshape=tuple(tensor.reshape.shape) if tensor.HasField("reshape") else None,
        optional=optional,
        label_filename=label_filename,
        allow_ragged_batch=ragged,
    )


def _warmup_sample(sample: Any) -> WarmupSample:
    data_type = model_config_pb2().DataType.Name
    inputs = []
    for name in sorted(sample.inputs):
        spec = sample.inputs[name]
        source = spec.WhichOneof("input_data_type")
        inputs.append(
            WarmupInput(
                name=name,
                datatype=from_config_type(data_type(spec.data_type)),
                dims=tuple(spec.dims),
                source={"zero_data": "zero", "random_data": "random"}.get(source, "file"),
                file=spec.input_data_file,
            )
        )
    return WarmupSample(
        name=sample.name,
        batch_size=sample.batch_size,
        inputs=tuple(inputs),
        count=max(1, sample.count),
    )


def _version_policy(policy: Any) -> VersionPolicy:
    which = policy.WhichOneof("policy_choice")
    if which == "all":
        return VersionPolicy(kind="all")
    if which == "specific":
        return VersionPolicy(kind="specific", versions=tuple(sorted(set(policy.specific.versions))))
    return VersionPolicy(kind="latest", num_versions=policy.latest.num_versions)


def _dynamic_batching(batching: Any) -> DynamicBatching:
    queue = batching.default_queue_policy
    return DynamicBatching(
        preferred_batch_sizes=tuple(batching.preferred_batch_size),
        max_queue_delay_us=batching.max_queue_delay_microseconds,
        preserve_ordering=batching.preserve_ordering,
        priority_levels=batching.priority_levels,
        default_priority_level=batching.default_priority_level,
        max_queue_size=queue.max_queue_size,
        default_timeout_us=queue.default_timeout_microseconds,
        allow_timeout_override=queue.allow_timeout_override,
        timeout_action=model_config_pb2().ModelQueuePolicy.TimeoutAction.Name(queue.timeout_action),
    )
