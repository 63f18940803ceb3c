"""JSON Lines batch jobs: each input line is a KServe v2 inference request (``inputs`` with
``name``, ``shape``, ``datatype`` and ``data``; optional ``id``), each output line the v2
response to it, in the same order."""

from __future__ import annotations

from typing import Any

import numpy as np
import orjson

from sluice.config import ModelConfig
from sluice.datatypes import from_numpy_dtype, numpy_dtype
from sluice.errors import InvalidInput


def request_arrays(request: Any, config: ModelConfig, where: str) -> dict[str, np.ndarray]:
    """The inputs of one v2 request, checked against the model's configuration."""
    if not isinstance(request, dict) or not isinstance(request.get("inputs"), list):
        raise InvalidInput(f"{where}: a request must be an object with an 'inputs' list")
    arrays: dict[str, np.ndarray] = {}
    for item in request["inputs"]:
        if not isinstance(item, dict):
            raise InvalidInput(f"{where}: each input must be an object")
        name, shape, datatype = item.get("name"), item.get("shape"), item.get("datatype")
        spec = config.input(name) if isinstance(name, str) else None
        if spec is None or not isinstance(name, str):
            raise InvalidInput(f"{where}: model '{config.name}' has no input {name!r}")
        if datatype != spec.datatype:
            raise InvalidInput(f"{where}: input '{name}' takes {spec.datatype}, not {datatype!r}")
        if not isinstance(shape, list) or not shape or not all(_dimension(d) for d in shape):
            raise InvalidInput(f"{where}: input '{name}' needs a shape of non-negative integers")
        data = item.get("data")
        try:
            if datatype == "BYTES":
                flat = np.array(
                    [v.encode() if isinstance(v, str) else bytes(v) for v in _flatten(data)],
                    dtype=object,
                )
            else:
                flat = np.asarray(data, dtype=numpy_dtype(datatype)).reshape(-1)
            arrays[name] = flat.reshape(shape)
        except (TypeError, ValueError) as exc:
            raise InvalidInput(f"{where}: input '{name}': {exc}") from None
    missing = [s.name for s in config.inputs if not s.optional and s.name not in arrays]
    if missing:
        raise InvalidInput(f"{where}: input '{missing[0]}' is missing")
    rows = {len(a) for a in arrays.values()}
    if len(rows) != 1:
        raise InvalidInput(f"{where}: the inputs do not have the same batch size")
    return arrays


def _dimension(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 31


def _flatten(data: Any) -> list[Any]:
    if isinstance(data, list):
        return [x for item in data for x in _flatten(item)]
    return [data]


def answer_line(
    request: dict[str, Any], model: str, version: int, outputs: dict[str, np.ndarray]
) -> bytes:
    """The v2 response to ``request`` as one JSON line."""
    body: dict[str, Any] = {"model_name": model, "model_version": str(version)}
    if isinstance(request.get("id"), str):
        body["id"] = request["id"]
    body["outputs"] = [
        {
            "name": name,
            "datatype": _datatype(array),
            "shape": list(array.shape),
            "data": [
                v.decode(errors="replace") if isinstance(v, bytes) else v
                for v in array.reshape(-1).tolist()
            ],
        }
        for name, array in outputs.items()
    ]
    return orjson.dumps(body)


def _datatype(array: np.ndarray) -> str:
    return from_numpy_dtype(array.dtype)
