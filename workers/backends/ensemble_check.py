"""What an ensemble's load checks against its composing models (Triton core
``ValidateEnsembleConfig``): each exists in the repository and is usable, names the
version asked for, has the inputs and outputs its maps name (every required input
mapped), batches at least as much as the ensemble, every ensemble tensor has one data
type and compatible shapes wherever it is declared (the ensemble's inputs and outputs, the
inputs and outputs of the steps that read and write it), no chain of ensembles leads back
to this one, and no step reads the responses of different decoupled models together.
Failing any of these fails the ensemble's load with the reason."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from sluice.core.config import LATEST, ModelConfig, TensorSpec
from sluice.core.datatypes import to_config_type
from sluice.core.errors import InvalidConfig
from sluice.core.repository import read_model
from sluice.core.settings import DEFAULT_MAX_BATCH_SIZE
from sluice.workers.backends.ensemble_graph import dims_match

_MAX_NESTING = 16
"""Ensembles within ensembles followed when looking for a cycle."""


def composing_configs(
    config: ModelConfig,
    repository: Path,
    config_name: str = "",
    *,
    default_max_batch_size: int = DEFAULT_MAX_BATCH_SIZE,
) -> list[ModelConfig]:
    """Each step's model configuration (custom configuration ``config_name`` where a model
    has one, and autocomplete's ``default_max_batch_size``), in step order; raises
    :class:`InvalidConfig`."""
    configs: list[ModelConfig] = []
    tensors = _ensemble_tensors(config)
    for index, step in enumerate(config.ensemble_steps):
        where = f"in ensemble '{config.name}', step {index} (model '{step.model_name}')"
        model_dir = repository / step.model_name
        if not model_dir.is_dir():
            raise InvalidConfig(f"{where}: model '{step.model_name}' is not in the repository")
        model = read_model(model_dir, config_name, default_max_batch_size=default_max_batch_size)
        if model.config is None or model.error:
            raise InvalidConfig(f"{where}: model '{step.model_name}' is unusable: {model.error}")
        if step.model_version != LATEST and step.model_version not in model.versions:
            served = ", ".join(map(str, model.versions))
            raise InvalidConfig(
                f"{where}: version {step.model_version} is not served (served: {served})"
            )
        _check_mapping(config, index, model.config)
        _check_consistency(config, index, model.config, tensors)
        configs.append(model.config)
    _check_nesting(config, repository, config_name, default_max_batch_size)
    _check_decoupled_flow(config, configs)
    return configs


def _check_decoupled_flow(ensemble: ModelConfig, configs: list[ModelConfig]) -> None:
    """No step reads tensors that come from different decoupled models' responses (or from
    one and from outside it): which of their responses would go together is undefined.
    Each tensor is labelled with the decoupled step its value comes from (0: none), as
    Triton's load labels them."""
    labels: dict[str, int] = {spec.name: 0 for spec in ensemble.inputs}
    waiting = list(range(len(ensemble.ensemble_steps)))
    decoupled_steps = 0
    while waiting:
        ready = [
            index
            for index in waiting
            if all(t in labels for t in ensemble.ensemble_steps[index].input_map.values())
        ]
        if not ready:
            return  # the rest never runs (an input nothing writes): not this check's business
        for index in ready:
            waiting.remove(index)
            step = ensemble.ensemble_steps[index]
            read = {labels[tensor] for tensor in step.input_map.values()}
            if len(read) > 1:
                raise InvalidConfig(
                    f"in ensemble {ensemble.name}, step of model '{step.model_name}' receives "
                    "inputs originated from different decoupled models"
                )
            label = read.pop() if read else 0
            if configs[index].decoupled:
                decoupled_steps += 1
                label = decoupled_steps
            for tensor in step.output_map.values():
                labels.setdefault(tensor, label)


def _check_mapping(ensemble: ModelConfig, index: int, model: ModelConfig) -> None:
    step = ensemble.ensemble_steps[index]
    prefix = f"in ensemble '{ensemble.name}', "
    for model_input, tensor in step.input_map.items():
        if model.input(model_input) is None:
            raise InvalidConfig(
                f"{prefix}ensemble tensor {tensor} is mapping to non-existing input "
                f"{model_input} in model {model.name}"
            )
    for spec in model.inputs:
        if spec.name not in step.input_map and not spec.optional:
            raise InvalidConfig(
                f"{prefix}input {spec.name} in model {model.name} is not mapped to any "
                "ensemble tensors"
            )
    for model_output, tensor in step.output_map.items():
        if model.output(model_output) is None:
            raise InvalidConfig(
                f"{prefix}ensemble tensor {tensor} is mapped from non-existing output "
                f"{model_output} in model {model.name}"
            )
    if 0 < model.max_batch_size < ensemble.max_batch_size:
        raise InvalidConfig(
            f"ensemble {ensemble.name} allows maximum batch size {ensemble.max_batch_size}, "
            f"but it contains model {model.name} which only allows maximum batch size to be "
            f"{model.max_batch_size}"
        )


@dataclass(frozen=True, slots=True)
class _Declared:
    """An ensemble tensor's data type and shape as one model declares it."""

    model: str
    datatype: str
    dims: tuple[int, ...]
    full_dims: tuple[int, ...]
    """``dims`` with the batch dimension (-1) of a model that batches."""


def _declared(model: ModelConfig, spec: TensorSpec, *, own: bool = False) -> _Declared:
    """``own``: the ensemble's input or output, whose shape is its reshape where it has one."""
    dims = spec.reshape if own and spec.reshape is not None else spec.dims
    batch = (-1,) if model.max_batch_size > 0 else ()
    return _Declared(model.name, spec.datatype, dims, batch + dims)


def _ensemble_tensors(ensemble: ModelConfig) -> dict[str, _Declared]:
    tensors = {spec.name: _declared(ensemble, spec, own=True) for spec in ensemble.inputs}
    for spec in ensemble.outputs:
        tensors.setdefault(spec.name, _declared(ensemble, spec, own=True))
    return tensors


def _check_consistency(
    ensemble: ModelConfig, index: int, model: ModelConfig, tensors: dict[str, _Declared]
) -> None:
    """Each ensemble tensor step ``index`` reads or writes has the data type and a shape
    compatible with every other declaration of it, as Triton requires: else a step would
    get another type than it declares (silently cast) or a shape it cannot take."""
    step = ensemble.ensemble_steps[index]
    mapped = [(model.input(name), tensor) for name, tensor in step.input_map.items()]
    mapped += [(model.output(name), tensor) for name, tensor in step.output_map.items()]
    for spec, tensor in mapped:
        if spec is None:
            continue  # (_check_mapping refused it)
        found = _declared(model, spec)
        first = tensors.setdefault(tensor, found)
        where = f"in ensemble {ensemble.name}, ensemble tensor {tensor}: inconsistent"
        if first.datatype != found.datatype:
            raise InvalidConfig(
                f"{where} data type: {to_config_type(first.datatype)} is inferred from model "
                f"{first.model} while {to_config_type(found.datatype)} is inferred from model "
                f"{found.model}"
            )
        if not dims_match(first.dims, found.dims) and not dims_match(
            first.full_dims, found.full_dims
        ):
            raise InvalidConfig(
                f"{where} shape: {_dims(first.full_dims)} is inferred from model {first.model} "
                f"while {_dims(found.full_dims)} is inferred from model {found.model}"
            )


def _dims(dims: tuple[int, ...]) -> str:
    return "[" + ",".join(map(str, dims)) + "]"


def _check_nesting(
    config: ModelConfig, repository: Path, config_name: str, default_max_batch_size: int
) -> None:
    """No ensemble among the composing models (at any depth) calls this one again: such
    a request would wait on itself until its deadline."""
    seen: set[str] = set()
    frontier = [step.model_name for step in config.ensemble_steps]
    for _depth in range(_MAX_NESTING):
        following: list[str] = []
        for name in frontier:
            if name == config.name:
                raise InvalidConfig(
                    f"ensemble '{config.name}' contains itself through nested ensembles "
                    "(circular dependency)"
                )
            if name in seen:
                continue
            seen.add(name)
            model = read_model(
                repository / name, config_name, default_max_batch_size=default_max_batch_size
            )
            if model.config is not None and model.config.is_ensemble:
                following.extend(step.model_name for step in model.config.ensemble_steps)
        if not following:
            return
        frontier = following
    raise InvalidConfig(f"ensemble '{config.name}' nests ensembles deeper than {_MAX_NESTING}")
