"""Pre-encoded KServe v2 inference requests (JSON or Triton's binary tensor extension)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson

from bench.client import Target, encode_request, model_path

MODES = ("binary", "json")

# Protocol datatypes the bench can generate random data for (BYTES and BF16 are not).
_NUMPY_DTYPES: dict[str, str] = {
    "BOOL": "|b1",
    "UINT8": "<u1",
    "UINT16": "<u2",
    "UINT32": "<u4",
    "UINT64": "<u8",
    "INT8": "<i1",
    "INT16": "<i2",
    "INT32": "<i4",
    "INT64": "<i8",
    "FP16": "<f2",
    "FP32": "<f4",
    "FP64": "<f8",
}


@dataclass(frozen=True)
class TensorSpec:
    name: str
    datatype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class InferRequest:
    """A request encoded once; ``raw`` is the full HTTP/1.1 message sent on every try."""

    mode: str
    items: int  # batch entries per request
    raw: bytes
    body_bytes: int


def tensor_specs(metadata: dict[str, Any], key: str) -> list[TensorSpec]:
    """The ``inputs`` or ``outputs`` of a ``GET /v2/models/<m>`` answer."""
    return [
        TensorSpec(entry["name"], entry["datatype"], tuple(int(d) for d in entry["shape"]))
        for entry in metadata[key]
    ]


def concrete_shape(shape: tuple[int, ...], batch: int, batched: bool) -> list[int]:
    """Replace the batch dimension by ``batch`` and any other variable dimension by 1."""
    dims = [1 if dim < 0 else dim for dim in shape]
    if batched:
        if not dims:
            raise ValueError("a batched model input has no batch dimension")
        dims[0] = batch
    return dims


def numpy_dtype(datatype: str) -> np.dtype[Any] | None:
    """The little-endian numpy dtype of a protocol datatype (None for BYTES and BF16)."""
    name = _NUMPY_DTYPES.get(datatype)
    return None if name is None else np.dtype(name)


def random_tensor(spec: TensorSpec, shape: list[int], rng: np.random.Generator) -> np.ndarray:
    """Seeded random data of the spec's datatype, little-endian."""
    dtype = numpy_dtype(spec.datatype)
    if dtype is None:
        raise ValueError(f"input {spec.name!r}: datatype {spec.datatype} is not supported")
    if dtype.kind == "f":
        return rng.standard_normal(shape).astype(dtype)
    if dtype.kind == "b":
        return rng.integers(0, 2, size=shape).astype(dtype)
    return rng.integers(0, 10, size=shape).astype(dtype)


def json_body(inputs: list[tuple[TensorSpec, np.ndarray]]) -> bytes:
    """KServe v2 JSON: every tensor as a flat ``data`` list; all outputs come back as JSON."""
    return orjson.dumps(
        {
            "inputs": [
                {
                    "name": spec.name,
                    "shape": list(array.shape),
                    "datatype": spec.datatype,
                    "data": array.ravel().tolist(),
                }
                for spec, array in inputs
            ]
        }
    )


def binary_body(
    inputs: list[tuple[TensorSpec, np.ndarray]], outputs: list[TensorSpec]
) -> tuple[bytes, int]:
    """Triton binary tensor extension: JSON header then raw tensors; returns (body, header size)."""
    header = orjson.dumps(
        {
            "inputs": [
                {
                    "name": spec.name,
                    "shape": list(array.shape),
                    "datatype": spec.datatype,
                    "parameters": {"binary_data_size": array.nbytes},
                }
                for spec, array in inputs
            ],
            "outputs": [
                {"name": spec.name, "parameters": {"binary_data": True}} for spec in outputs
            ],
        }
    )
    return header + b"".join(array.tobytes() for _, array in inputs), len(header)


def request_inputs(
    metadata: dict[str, Any], max_batch_size: int, batch: int = 1, seed: int = 0
) -> list[tuple[TensorSpec, np.ndarray]]:
    """The seeded random inputs of a request of ``batch`` entries (the same for every wire)."""
    batched = max_batch_size > 0
    if batched and not 1 <= batch <= max_batch_size:
        raise ValueError(f"batch {batch} is outside 1..{max_batch_size} (max_batch_size)")
    rng = np.random.default_rng(seed)
    return [
        (spec, random_tensor(spec, concrete_shape(spec.shape, batch, batched), rng))
        for spec in tensor_specs(metadata, "inputs")
    ]


def build_request(
    target: Target,
    model: str,
    metadata: dict[str, Any],
    max_batch_size: int,
    mode: str,
    batch: int = 1,
    seed: int = 0,
) -> InferRequest:
    """Encode ``POST /v2/models/<model>/infer`` with random inputs of ``batch`` entries."""
    inputs = request_inputs(metadata, max_batch_size, batch, seed)
    headers: dict[str, str]
    if mode == "json":
        body = json_body(inputs)
        headers = {"Content-Type": "application/json"}
    elif mode == "binary":
        body, header_size = binary_body(inputs, tensor_specs(metadata, "outputs"))
        headers = {
            "Content-Type": "application/octet-stream",
            "Inference-Header-Content-Length": str(header_size),
        }
    else:
        raise ValueError(f"unknown mode {mode!r}; expected one of {', '.join(MODES)}")
    raw = encode_request(target, "POST", model_path(model, "/infer"), body, headers)
    items = batch if max_batch_size > 0 else 1
    return InferRequest(mode=mode, items=items, raw=raw, body_bytes=len(body))
