"""``python -m bench.parse_cost``: what parsing one request costs, by the shape of its body.

The gateway parses a request on the event loop or hands it to a thread
(:func:`sluice.gateway.inference.data_plane.parsed_heavily`,
:func:`sluice.gateway.grpc_api.offload.decoded_on_thread`); whatever runs on the loop delays
every other request of the process. This times, in one process and without a server, the
gateway's work on a body of each worst-case kind of about ``--bytes`` bytes (the most
elements that many bytes can hold: JSON numbers, nested JSON, JSON strings, each kind of
gRPC typed contents, empty ``bytes_contents``, BYTES elements in binary data, raw binary)
and says which way the gateway sends it. REST: the JSON parse and every check; gRPC: the
decode, then the conversion and the checks. Reported: the median of ``--repeat`` runs, in
µs, and what one hand-off to a thread costs the event loop and the request.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson
from tritonclient.grpc import service_pb2

from sluice.core.config.model import ModelConfig
from sluice.core.config.parse import parse_config_text
from sluice.gateway.grpc_api.infer import _decode
from sluice.gateway.grpc_api.offload import decoded_on_thread
from sluice.gateway.grpc_api.tensors import request_document
from sluice.gateway.inference.data_plane import OFFLOAD_BYTES, parsed_heavily
from sluice.gateway.inference.parsing import parse_infer_document, parse_infer_request
from sluice.gateway.inference.request import RequestLimits

_LIMITS = RequestLimits()
_HEADER_ROOM = 160
"""Bytes a body's own header takes besides its data (so that the whole fits ``--bytes``)."""
_TRITON_TYPES = {"BYTES": "STRING"}


@dataclass
class Case:
    name: str
    body: bytes
    on_thread: bool
    steps: tuple[Callable[[], Any], ...]
    """The work, in the order the gateway does it (gRPC: decode, then the rest)."""


def _config(datatype: str, dims: str = "[ -1 ]") -> ModelConfig:
    return parse_config_text(
        f'name: "m" max_batch_size: 0 input [ {{ name: "x" data_type: '
        f"TYPE_{_TRITON_TYPES.get(datatype, datatype)} dims: {dims} }} ] "
        'output [ { name: "y" data_type: TYPE_FP32 dims: [ 1 ] } ]',
        model_name="m",
    )


def _rest(
    name: str, datatype: str, data: list[Any], shape: list[int], dims: str = "[ -1 ]"
) -> Case:
    entry = {"name": "x", "datatype": datatype, "shape": shape, "data": data}
    body = orjson.dumps({"inputs": [entry]})
    return _rest_body(name, body, None, _config(datatype, dims))


def _rest_body(name: str, body: bytes, json_length: int | None, config: ModelConfig) -> Case:
    def parse() -> Any:
        return parse_infer_request(body, json_length, config, _LIMITS)

    return Case(name, body, parsed_heavily(body, json_length), (parse,))


def _binary_extension(name: str, datatype: str, data: bytes, count: int) -> Case:
    entry = {
        "name": "x",
        "datatype": datatype,
        "shape": [count],
        "parameters": {"binary_data_size": len(data)},
    }
    header = orjson.dumps({"inputs": [entry]})
    return _rest_body(name, header + data, len(header), _config(datatype))


def _grpc(name: str, datatype: str, field: str | None, values: Any, count: int) -> Case:
    request = service_pb2.ModelInferRequest(model_name="m", id="r")
    tensor = request.inputs.add(name="x", datatype=datatype, shape=[count])
    if field is None:
        request.raw_input_contents.append(values)
    else:
        getattr(tensor.contents, field).extend(values)
    message = request.SerializeToString()
    config = _config(datatype)
    decoded: list[Any] = [_decode(message, _LIMITS)]

    def decode() -> None:
        decoded[0] = _decode(message, _LIMITS)

    def parse() -> Any:
        document, binary = request_document(decoded[0])
        return parse_infer_document(document, binary, config, _LIMITS)

    return Case(name, message, decoded_on_thread(message), (decode, parse))


def _length_prefixed(count: int) -> bytes:
    return struct.pack("<I", 0) * count


def cases(size: int) -> list[Case]:
    """Each kind of body, of about ``size`` bytes and as many elements as that holds."""
    room = max(8, size - _HEADER_ROOM)

    def n(width: int) -> int:
        return max(1, room // width)

    zeros = np.zeros(n(1), np.int64)
    return [
        _rest("REST JSON numbers `0,`", "FP32", [0] * n(2), [n(2)]),
        _rest("REST JSON numbers `0.5,`", "FP32", [0.5] * n(4), [n(4)]),
        _rest("REST JSON nested `[0],`", "FP32", [[0]] * n(4), [n(4), 1], "[ -1, 1 ]"),
        _rest('REST JSON strings `"",`', "BYTES", [""] * n(3), [n(3)]),
        _binary_extension("REST binary extension FP32", "FP32", bytes(n(4) * 4), n(4)),
        _binary_extension(
            "REST binary extension BYTES `\\0\\0\\0\\0`", "BYTES", _length_prefixed(n(4)), n(4)
        ),
        _rest_body("REST raw binary (no JSON)", bytes(n(4) * 4), 0, _config("FP32", f"[ {n(4)} ]")),
        _grpc("gRPC raw_input_contents FP32", "FP32", None, bytes(n(4) * 4), n(4)),
        _grpc("gRPC raw_input_contents BYTES", "BYTES", None, _length_prefixed(n(4)), n(4)),
        _grpc("gRPC fp32_contents", "FP32", "fp32_contents", np.zeros(n(4), np.float32), n(4)),
        _grpc("gRPC fp64_contents", "FP64", "fp64_contents", np.zeros(n(8), np.float64), n(8)),
        _grpc("gRPC int_contents (INT32) `0`", "INT32", "int_contents", zeros, n(1)),
        _grpc("gRPC int_contents (INT8) `0`", "INT8", "int_contents", zeros, n(1)),
        _grpc("gRPC int64_contents `0`", "INT64", "int64_contents", zeros, n(1)),
        _grpc("gRPC uint64_contents `0`", "UINT64", "uint64_contents", zeros, n(1)),
        _grpc("gRPC bool_contents", "BOOL", "bool_contents", zeros.astype(bool), n(1)),
        _grpc('gRPC bytes_contents `b""`', "BYTES", "bytes_contents", [b""] * n(2), n(2)),
    ]


def _median_us(step: Callable[[], Any], repeat: int) -> float:
    step()
    times = []
    for _ in range(repeat):
        start = time.perf_counter_ns()
        step()
        times.append(time.perf_counter_ns() - start)
    return statistics.median(times) / 1_000


async def _hop_us(repeat: int) -> tuple[float, float]:
    """One ``asyncio.to_thread`` of nothing: the loop's CPU for it, and its wall time."""
    await asyncio.to_thread(int)
    cpu, wall = [], []
    for _ in range(repeat):
        start, start_cpu = time.perf_counter_ns(), time.thread_time_ns()
        await asyncio.to_thread(int)
        cpu.append(time.thread_time_ns() - start_cpu)
        wall.append(time.perf_counter_ns() - start)
    return statistics.median(cpu) / 1_000, statistics.median(wall) / 1_000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bytes", type=int, nargs="+", default=[OFFLOAD_BYTES, 4096, 512])
    parser.add_argument("--repeat", type=int, default=50)
    args = parser.parse_args()
    print("| body | bytes | µs (gRPC: decode + rest) | where |")
    print("| --- | --- | --- | --- |")
    for size in args.bytes:
        for case in cases(size):
            steps = [_median_us(step, args.repeat) for step in case.steps]
            micros = f"{sum(steps):,.0f}"
            if len(steps) > 1:
                micros += " (" + " + ".join(f"{s:,.0f}" for s in steps) + ")"
            where = "thread" if case.on_thread else "loop"
            print(f"| {case.name} | {len(case.body):,} | {micros} | {where} |")
    cpu, wall = asyncio.run(_hop_us(args.repeat * 10))
    print(f"\nasyncio.to_thread of nothing: {cpu:,.0f} µs of the loop's CPU, {wall:,.0f} µs wall")


if __name__ == "__main__":
    main()
