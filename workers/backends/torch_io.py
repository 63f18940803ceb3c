"""How the PyTorch backend maps config tensors onto a model's arguments and results.

Triton's libtorch convention: inputs are passed positionally, ordered by the
``<name>__<index>`` suffix when every input name has one, else by the position
of the same-named ``forward`` argument when every input has one, else in config
order; outputs map the same way onto a returned tuple (by suffix, else in config
order), and a returned dict is read by output name.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from sluice.core.config import ModelConfig, TensorSpec
from sluice.core.errors import InferenceFailed, InvalidInput

_INDEXED = re.compile(r"^.+__(\d+)$")


def _indexed_order(names: Sequence[str]) -> list[int] | None:
    """The ``__<index>`` of every name, when all have a distinct one."""
    matches = [_INDEXED.match(name) for name in names]
    if not names or not all(matches):
        return None
    indices = [int(m.group(1)) for m in matches if m]
    return indices if len(set(indices)) == len(indices) else None


@dataclass(frozen=True, slots=True)
class Signature:
    """Which config input goes where in the call, which result is which output."""

    positional: tuple[str | None, ...]
    """Config input names by argument position (None: an argument no input feeds)."""
    output_index: Mapping[str, int]

    @classmethod
    def of(cls, config: ModelConfig, forward_names: Sequence[str] | None) -> Signature:
        names = [spec.name for spec in config.inputs]
        indices = _indexed_order(names)
        if indices is None and forward_names and set(names) <= set(forward_names):
            indices = [forward_names.index(name) for name in names]
        positional: tuple[str | None, ...] = tuple(names)
        if indices is not None:
            by_index = dict(zip(indices, names, strict=True))
            positional = tuple(by_index.get(i) for i in range(max(indices) + 1))
        outputs = [spec.name for spec in config.outputs]
        out_indices = _indexed_order(outputs)
        output_index = dict(zip(outputs, out_indices or range(len(outputs)), strict=True))
        return cls(positional, output_index)


def to_torch(
    name: str, array: np.ndarray, spec: TensorSpec | None, device: torch.device
) -> torch.Tensor | list[str]:
    """A tensor sharing the array's memory on CPU; BYTES become a flat ``List[str]``."""
    if array.dtype == np.object_:
        try:
            return [v.decode() if isinstance(v, bytes) else str(v) for v in array.reshape(-1)]
        except UnicodeDecodeError:
            raise InvalidInput(
                f"input '{name}': an element is not valid UTF-8, and TorchScript strings are text"
            ) from None
    if array.flags.writeable:
        tensor = torch.from_numpy(array)
    else:
        # Read-only views over the request payload: the model only reads its inputs, so
        # sharing is safe, and copying every input to silence torch would cost more.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "The given NumPy array is not writable")
            tensor = torch.from_numpy(array)
    if spec is not None and spec.datatype == "BF16":
        tensor = tensor.to(torch.bfloat16)
    if device.type != "cpu":
        tensor = tensor.to(device)
    return tensor


def to_numpy(name: str, value: Any) -> np.ndarray:
    """A result of the model as numpy (bfloat16 as float32, ``List[str]`` as BYTES)."""
    if isinstance(value, torch.Tensor):
        tensor = value.detach()
        if tensor.dtype == torch.bfloat16:
            tensor = tensor.float()
        if tensor.device.type != "cpu":
            tensor = tensor.cpu()
        return tensor.numpy()
    if isinstance(value, list | tuple) and all(isinstance(v, str | bytes) for v in value):
        strings = np.empty(len(value), dtype=np.object_)
        strings[:] = [v.encode() if isinstance(v, str) else v for v in value]
        return strings
    if isinstance(value, int | float | bool):
        return np.asarray(value)
    raise InferenceFailed(
        f"output '{name}': the model returned {type(value).__name__}, not a tensor"
    )


def results_by_name(
    result: Any, wanted: Sequence[str], output_index: Mapping[str, int]
) -> dict[str, Any]:
    """Pick the wanted outputs from what ``forward`` returned."""
    if isinstance(result, Mapping):
        missing = [name for name in wanted if name not in result]
        if missing:
            raise InferenceFailed(
                f"the model returned no output '{missing[0]}' "
                f"(it returned {', '.join(map(str, result))})"
            )
        return {name: result[name] for name in wanted}
    is_string_list = isinstance(result, list) and all(isinstance(v, str) for v in result)
    values = list(result) if isinstance(result, tuple | list) and not is_string_list else [result]
    picked: dict[str, Any] = {}
    for name in wanted:
        index = output_index[name]
        if index >= len(values):
            raise InferenceFailed(
                f"output '{name}' is result #{index} of the model, "
                f"but it returned {len(values)} result(s)"
            )
        picked[name] = values[index]
    return picked
