"""``sequence_batching``: stateful models whose requests carry a correlation id.

Triton's semantics, read from its ``model_config.proto``: a strategy (``direct``, the
default, or ``oldest``), the idle time after which a sequence is forgotten
(``max_sequence_idle_microseconds``, default one second), control inputs the server fills
(START, END, READY, CORRID) and implicit state (``state``: an input the server feeds
with what the model returned in an output on the sequence's previous request).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sluice.core.datatypes import from_config_type

from ._schema import model_config_pb2
from .paths import plain_name_problem

DEFAULT_IDLE_US = 1_000_000
"""Triton's default ``max_sequence_idle_microseconds``."""

BOOLEAN_CONTROLS = ("START", "END", "READY")
CORRID_TYPES = ("UINT64", "INT64", "UINT32", "INT32", "BYTES")


@dataclass(frozen=True, slots=True)
class SequenceControl:
    kind: str
    """START, END, READY or CORRID (``CONTROL_SEQUENCE_<kind>``)."""
    name: str
    """The model input the server fills."""
    datatype: str
    false_value: float | int | bool = 0
    true_value: float | int | bool = 1


@dataclass(frozen=True, slots=True)
class SequenceState:
    input_name: str
    output_name: str
    datatype: str
    dims: tuple[int, ...]
    initial_file: str = ""
    """The initial state's data file under ``<model>/initial_state/`` (empty: zeros)."""
    initial_dims: tuple[int, ...] = ()
    """The initial state's shape (dims of ``initial_state``; else ``dims``)."""


@dataclass(frozen=True, slots=True)
class SequenceBatching:
    strategy: str
    """"direct" or "oldest"."""
    max_sequence_idle_us: int
    controls: tuple[SequenceControl, ...] = ()
    states: tuple[SequenceState, ...] = ()
    max_queue_delay_us: int = 0
    preferred_batch_sizes: tuple[int, ...] = ()
    max_candidate_sequences: int = 0

    def control(self, kind: str) -> SequenceControl | None:
        return next((c for c in self.controls if c.kind == kind), None)

    @property
    def server_inputs(self) -> frozenset[str]:
        """Model inputs the server fills: controls and states (never sent by clients)."""
        return frozenset(c.name for c in self.controls) | {s.input_name for s in self.states}


def _type_name(value: int) -> str:
    return str(model_config_pb2().DataType.Name(value))


def build_sequence_batching(batching: Any) -> SequenceBatching:
    """The typed view of a validated ``sequence_batching`` message."""
    strategy = "oldest" if batching.WhichOneof("strategy_choice") == "oldest" else "direct"
    chosen = batching.oldest if strategy == "oldest" else batching.direct
    controls: list[SequenceControl] = []
    for control_input in batching.control_input:
        for control in control_input.control:
            kind = _kind(control.kind)
            if kind == "CORRID":
                datatype = from_config_type(_type_name(control.data_type))
                controls.append(SequenceControl(kind, control_input.name, datatype))
                continue
            datatype, values = _boolean_values(control)
            controls.append(SequenceControl(kind, control_input.name, datatype, *values))
    states = []
    for state in batching.state:
        initial = state.initial_state[0] if state.initial_state else None
        states.append(
            SequenceState(
                input_name=state.input_name,
                output_name=state.output_name,
                datatype=from_config_type(_type_name(state.data_type)),
                dims=tuple(state.dims),
                initial_file=initial.data_file if initial is not None else "",
                initial_dims=tuple(initial.dims) if initial is not None else (),
            )
        )
    return SequenceBatching(
        strategy=strategy,
        max_sequence_idle_us=batching.max_sequence_idle_microseconds or DEFAULT_IDLE_US,
        controls=tuple(controls),
        states=tuple(states),
        max_queue_delay_us=chosen.max_queue_delay_microseconds,
        preferred_batch_sizes=tuple(batching.oldest.preferred_batch_size)
        if strategy == "oldest"
        else (),
        max_candidate_sequences=batching.oldest.max_candidate_sequences
        if strategy == "oldest"
        else 0,
    )


def _kind(value: int) -> str:
    name = str(model_config_pb2().ModelSequenceBatching.Control.Kind.Name(value))
    return name.removeprefix("CONTROL_SEQUENCE_")


def _boolean_values(control: Any) -> tuple[str, tuple[Any, Any]]:
    if len(control.int32_false_true):
        return "INT32", (int(control.int32_false_true[0]), int(control.int32_false_true[1]))
    if len(control.fp32_false_true):
        return "FP32", (float(control.fp32_false_true[0]), float(control.fp32_false_true[1]))
    return "BOOL", (bool(control.bool_false_true[0]), bool(control.bool_false_true[1]))


def sequence_batching_problem(msg: Any) -> str | None:
    """Why ``msg.sequence_batching`` cannot be served, or None. Messages follow Triton's."""
    batching = msg.sequence_batching
    if msg.model_transaction_policy.decoupled:
        return "decoupled models (model_transaction_policy) cannot be sequence models yet"
    seen_kinds: set[str] = set()
    names: set[str] = set()
    client_inputs = {tensor.name for tensor in msg.input}
    for control_input in batching.control_input:
        if not control_input.name:
            return "control_input: name must not be empty"
        if control_input.name in client_inputs:
            return f"control_input '{control_input.name}' is also a model input in 'input'"
        if len(control_input.control) != 1:
            return f"control_input '{control_input.name}' must have exactly one control"
        names.add(control_input.name)
        for control in control_input.control:
            kind = _kind(control.kind)
            if kind in seen_kinds:
                return f"sequence_batching has more than one CONTROL_SEQUENCE_{kind} control"
            seen_kinds.add(kind)
            label = f"control_input '{control_input.name}' (CONTROL_SEQUENCE_{kind})"
            if kind == "CORRID":
                try:
                    datatype = from_config_type(_type_name(control.data_type))
                except ValueError:
                    datatype = ""
                if datatype not in CORRID_TYPES:
                    return (
                        f"{label}: data_type must be TYPE_UINT64, TYPE_INT64, TYPE_UINT32, "
                        "TYPE_INT32 or TYPE_STRING"
                    )
                continue
            lists = [
                len(control.int32_false_true),
                len(control.fp32_false_true),
                len(control.bool_false_true),
            ]
            if sorted(lists) != [0, 0, 2]:
                return (
                    f"{label}: exactly one of int32_false_true, fp32_false_true and "
                    "bool_false_true must hold two values (false, true)"
                )
    for state in batching.state:
        label = f"state '{state.input_name}'"
        if not state.input_name or not state.output_name:
            return "state: input_name and output_name must both be set"
        if state.input_name in client_inputs or state.input_name in names:
            return f"{label}: input_name is also a model or control input"
        names.add(state.input_name)
        try:
            from_config_type(_type_name(state.data_type))
        except ValueError:
            return f"{label}: unsupported data_type {state.data_type}"
        if not state.dims or any(d == 0 or d < -1 for d in state.dims):
            return f"{label}: dims must be non-empty, each > 0 or -1"
        if len(state.initial_state) > 1:
            return f"{label}: at most one initial_state is supported"
        for initial in state.initial_state:
            if initial.data_type != state.data_type:
                return f"{label}: initial_state data_type differs from the state's"
            if any(d <= 0 for d in initial.dims):
                return f"{label}: initial_state dims must all be > 0"
            if initial.WhichOneof("state_data") == "data_file":
                name = initial.data_file
                if plain_name_problem(name):
                    return f"{label}: initial_state data_file must be a plain file name"
            elif not initial.zero_data:
                return f"{label}: initial_state needs zero_data: true or a data_file"
    oldest = batching.oldest
    is_oldest = batching.WhichOneof("strategy_choice") == "oldest"
    if is_oldest and any(size <= 0 for size in oldest.preferred_batch_size):
        return "oldest: preferred_batch_size values must be > 0"
    return None
