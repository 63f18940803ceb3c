"""The checks Triton applies to ``ensemble_scheduling`` on its own (core
``ValidateEnsembleSchedulingConfig``), and the order its steps can run in.

What can be checked from the ensemble's configuration alone is checked here, when the
configuration is parsed: the steps form a graph over named *ensemble tensors* in which
every tensor is written once, every ensemble input is read, every ensemble output is
written, and there is no cycle. What needs the composing models' configurations (their
tensor names, batch sizes) is checked when the ensemble loads (the worker's backend).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from .model import ENSEMBLE_PLATFORM as ENSEMBLE
from .paths import model_name_problem

LATEST = -1
"""``model_version`` meaning the latest ready version of the composing model."""


class StepLike(Protocol):
    """What the graph checks need of a step (a typed step, or a protobuf one)."""

    @property
    def model_name(self) -> str: ...

    @property
    def input_map(self) -> Mapping[str, str]: ...

    @property
    def output_map(self) -> Mapping[str, str]: ...


class CycleError(ValueError):
    """The steps cannot be ordered: some read what they (indirectly) write."""


def ensemble_problem(msg: Any) -> str | None:
    """The first problem of a ModelConfig message's ensemble fields, as
    ``field: reason``; None when they are fine (or the model is no ensemble)."""
    has_scheduling = msg.HasField("ensemble_scheduling")
    if msg.platform != ENSEMBLE:
        if has_scheduling:
            return (
                "ensemble_scheduling: may only be set for a model whose platform is "
                f"'{ENSEMBLE}' (platform is '{msg.platform}')"
            )
        return None
    if not has_scheduling:
        return f"ensemble_scheduling: must be set for a model whose platform is '{ENSEMBLE}'"
    steps = list(msg.ensemble_scheduling.step)
    if not steps:
        return "ensemble_scheduling: must have at least one step"
    for index, step in enumerate(steps):
        where = f"ensemble_scheduling.step[{index}]"
        if not step.model_name:
            return f"{where}: model_name must be set"
        if model_name_problem(step.model_name):
            return f"{where}: model_name {step.model_name!r} is not the name of a model"
        if step.model_name == msg.name:
            return (
                f"{where}: model_name '{step.model_name}' is the ensemble itself "
                "(circular dependency)"
            )
        if step.model_version != LATEST and step.model_version < 1:
            return (
                f"{where} (model '{step.model_name}'): model_version must be -1 (the latest "
                f"version) or a version >= 1, got {step.model_version}"
            )
        if not step.input_map:
            return f"{where} (model '{step.model_name}'): input_map must not be empty"
        if not step.output_map:
            return f"{where} (model '{step.model_name}'): output_map must not be empty"
    return graph_problem(
        msg.name,
        [tensor.name for tensor in msg.input],
        [tensor.name for tensor in msg.output],
        steps,
    )


def graph_problem(
    name: str, inputs: Sequence[str], outputs: Sequence[str], steps: Sequence[StepLike]
) -> str | None:
    """Whether the steps wire the ensemble's inputs to its outputs as Triton requires."""
    ensemble_inputs = set(inputs)
    producer: dict[str, int] = {}
    for index, step in enumerate(steps):
        for tensor in step.output_map.values():
            where = f"ensemble_scheduling.step[{index}] (model '{step.model_name}')"
            if tensor in ensemble_inputs:
                return f"{where}: ensemble tensor '{tensor}' is an input of ensemble '{name}'"
            if tensor in producer:
                return (
                    f"{where}: ensemble tensor '{tensor}' can appear in an output map only "
                    f"once (step[{producer[tensor]}] writes it too)"
                )
            producer[tensor] = index
    read: set[str] = set()
    for index, step in enumerate(steps):
        for tensor in step.input_map.values():
            if tensor not in ensemble_inputs and tensor not in producer:
                return (
                    f"ensemble_scheduling.step[{index}] (model '{step.model_name}'): ensemble "
                    f"tensor '{tensor}' is neither an input of ensemble '{name}' nor written "
                    "by any step"
                )
            read.add(tensor)
    for tensor in inputs:
        if tensor not in read:
            return f"input '{tensor}' for ensemble '{name}' is not used"
    for tensor in outputs:
        if tensor not in producer:
            return f"output '{tensor}' for ensemble '{name}' is not written"
    try:
        step_levels(steps, ensemble_inputs)
    except CycleError as exc:
        return f"ensemble_scheduling: {exc}"
    return None


def step_levels(steps: Sequence[StepLike], inputs: set[str]) -> list[list[int]]:
    """The steps in waves: each wave's steps read only ensemble inputs and what earlier
    waves write, so a wave's steps may run together. Raises :class:`CycleError`."""
    available = set(inputs)
    waiting = list(range(len(steps)))
    levels: list[list[int]] = []
    while waiting:
        ready = [i for i in waiting if set(steps[i].input_map.values()) <= available]
        if not ready:
            stuck = ", ".join(f"step[{i}] (model '{steps[i].model_name}')" for i in waiting)
            raise CycleError(f"the steps {stuck} depend on each other (a cycle)")
        levels.append(ready)
        for index in ready:
            available.update(steps[index].output_map.values())
        waiting = [i for i in waiting if i not in ready]
    return levels
