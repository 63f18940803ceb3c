"""Triton's classification extension: an output's top-N classes instead of its values.

A request asks for it per output (``parameters.classification: N``; tritonclient's
``InferRequestedOutput(name, class_count=N)``). The answer replaces that output by a
BYTES tensor of ``"value:index"`` strings, ``"value:index:label"`` when the output's
``label_filename`` (one label per line, in the model directory) names a label for the
index. As Triton (server ``src/classification.cc`` and ``src/http_server.cc``): classes
sorted by value, highest first; ``k = min(N, elements per batch item)``; shape
``[batch, k]`` for batching models, ``[k]`` otherwise; values printed as C's ``%f`` for
FP32/FP64 and as decimal integers for integer types; any other datatype is refused.

The gateway checks the request (it has the datatype); the worker, which has the model
directory, reads the labels when the model loads and computes the classes.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from sluice.core.datatypes import serialize_bytes

CLASSIFIABLE = frozenset(
    {"UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64", "FP32", "FP64"}
)
"""The datatypes Triton ranks (``TopkClassifications``); BOOL, FP16, BF16, BYTES are not."""


def unsupported_message(datatype: str) -> str:
    """Triton's text for an output whose datatype cannot be ranked."""
    return f"class result not available for output due to unsupported type '{datatype}'"


def read_labels(path: Path) -> list[bytes]:
    """One label per line, as Triton's ``LabelProvider`` reads them (``std::getline``:
    no empty label after a final newline; a label is sent as the file's bytes)."""
    lines = path.read_bytes().split(b"\n")
    if lines[-1] == b"":
        lines.pop()
    return lines


def classify(
    array: np.ndarray, count: int, batched: bool, labels: Sequence[bytes]
) -> tuple[tuple[int, ...], bytes]:
    """The shape and BYTES buffer of ``array``'s top ``count`` classes per batch item.

    Equal values keep index order (Triton's ``std::sort`` leaves their order unspecified);
    NaNs rank last.
    """
    rows = array.reshape(array.shape[0] if batched and array.ndim else 1, -1)
    k = min(count, rows.shape[1])
    floats = rows.dtype.kind == "f"
    if floats:
        order = np.argsort(-rows, axis=1, kind="stable")[:, :k]
    else:  # descending without negating (unsigned): a stable sort of the mirrored row
        width = rows.shape[1]
        order = (width - 1 - np.argsort(rows[:, ::-1], axis=1, kind="stable"))[:, ::-1][:, :k]
    elements: list[bytes] = []
    for row, indices in zip(rows, order, strict=True):
        for index in indices.tolist():
            value = row[index]
            text = f"{float(value):f}:{index}" if floats else f"{int(value)}:{index}"
            label = labels[index] if index < len(labels) else b""
            elements.append(b"%s:%s" % (text.encode(), label) if label else text.encode())
    shape = (rows.shape[0], k) if batched and array.ndim else (k,)
    return shape, serialize_bytes(elements)
