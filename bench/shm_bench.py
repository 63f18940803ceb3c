"""``python -m bench.shm_bench``: large tensors over JSON, binary HTTP and shared memory.

An identity ONNX model (FP32 ``[-1]`` in, the same out, ``max_batch_size: 0``) is built in
a temporary repository and served by ``sluice up`` (or give ``--url`` of a stack serving
that repository: ``--write-repository DIR`` writes it). One tritonclient client sends
1, 16 and 64 MB tensors back to back through each path and the table gives the latency
p50 and the throughput (tensor MB per second, one request at a time) per size and path:

- ``json``: tensors as JSON numbers, both ways;
- ``binary``: Triton's binary tensor extension; on one host the gateway moves tensors above
  ``SLUICE_SHM_THRESHOLD_BYTES`` to the worker and back through shared memory segments;
- ``binary-redis`` (with ``--redis-path``): the same with the threshold at 0, so the bytes
  travel inside the Redis entries (what happens across hosts);
- ``shm``: the input in a registered system shared memory region, the output requested into
  another; the timing includes the client writing the input into its region.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import numpy as np

from bench.stack import start_stack, stop_stack

MODEL = "identity"
MB = 1 << 20
THRESHOLD = 1 * MB  # the default SLUICE_SHM_THRESHOLD_BYTES: larger tensors avoid Redis
STACK_ENV = {
    "SLUICE_SHM_SAME_HOST": "true",
    "SLUICE_SHM_THRESHOLD_BYTES": str(THRESHOLD),
    "SLUICE_MAX_BODY_BYTES": str(1 << 30),  # JSON of a 64 MB tensor is about 300 MB
    "SLUICE_DEFAULT_TIMEOUT_S": "300",
}

# Copies of the tensor bytes on the server side (gateway, Redis, worker), counted from the
# code (uvicorn, the fast path, redis-py/hiredis, Redis), both directions; the model's own
# Identity copy is not counted. [k]: a kernel copy (socket send or receive, tmpfs write),
# [u]: a user-space memcpy. Client-side copies are listed apart.
COPIES: dict[str, tuple[str, str, str]] = {
    "binary-redis": (
        "~30",
        "request: socket→uvicorn [k]; httptools→bytes, uvicorn bytearray +=, uvicorn "
        "bytes(), fast-path bytearray +=, fast-path bytes() [u x5]; entry payload join [u]; "
        "gateway→Redis [k x2]; stream listpack, XREADGROUP reply buffer [u x2]; "
        "Redis→worker [k x2]; asyncio stream buffer, read(), hiredis buffer, bytes object "
        "[u x4]; numpy view (no copy). reply: split join [u]; worker→Redis [k x2]; listpack, "
        "reply buffer [u x2]; Redis→gateway [k x2]; stream buffer, read(), hiredis, bytes "
        "[u x4]; response join [u]; gateway→client [k]",
        "tobytes, body join, socket [k]; response socket [k], read buffer; as_numpy view",
    ),
    "binary": (
        "10",
        "request: socket→uvicorn [k]; httptools→bytes, uvicorn bytearray +=, uvicorn "
        "bytes(), fast-path bytearray +=, fast-path bytes() [u x5]; pwrite into the "
        "gateway's segment [k]; the worker maps it (no copy). reply: pwrite into the "
        "worker's segment [k]; the gateway maps it; response join [u]; gateway→client [k]",
        "tobytes, body join, socket [k]; response socket [k], read buffer; as_numpy view",
    ),
    "shm": (
        "2",
        "request: the worker preads the client's region into a fresh buffer [k] (never a "
        "mapping: a client that shrinks its object must not crash the worker); "
        "reply: the worker pwrites the output into the client's region [k]",
        "set_shared_memory_region copies the input in; get_contents_as_numpy is a view",
    ),
    "json": (
        "10 + 4 conversions",
        "as binary, plus text→Python floats (orjson), list→float64 array, →FP32 on the way "
        "in and FP32→JSON text (orjson) on the way out",
        "tolist + JSON encoding; JSON parsing + np.array",
    ),
}


def write_repository(root: Path) -> Path:
    """``identity``: FP32 ``INPUT [-1]`` → ``OUTPUT`` (ONNX Identity), no batching."""
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Identity", ["INPUT"], ["OUTPUT"])],
        MODEL,
        [helper.make_tensor_value_info("INPUT", TensorProto.FLOAT, [None])],
        [helper.make_tensor_value_info("OUTPUT", TensorProto.FLOAT, [None])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    (root / MODEL / "1").mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(root / MODEL / "1" / "model.onnx"))
    (root / MODEL / "config.pbtxt").write_text(
        f'name: "{MODEL}"\nplatform: "onnxruntime_onnx"\nmax_batch_size: 0\n'
        'input [ { name: "INPUT" data_type: TYPE_FP32 dims: [ -1 ] } ]\n'
        'output [ { name: "OUTPUT" data_type: TYPE_FP32 dims: [ -1 ] } ]\n'
    )
    return root


Request = Callable[[np.ndarray], np.ndarray]


def http_path(client: Any, binary: bool) -> Request:
    import tritonclient.http as httpclient

    def send(data: np.ndarray) -> np.ndarray:
        tensor = httpclient.InferInput("INPUT", list(data.shape), "FP32")
        tensor.set_data_from_numpy(data, binary_data=binary)
        output = httpclient.InferRequestedOutput("OUTPUT", binary_data=binary)
        result: np.ndarray = client.infer(MODEL, [tensor], outputs=[output]).as_numpy("OUTPUT")
        return result

    return send


def shm_path(client: Any, nbytes: int, cleanup: ExitStack) -> Request:
    import tritonclient.http as httpclient
    import tritonclient.utils.shared_memory as shm

    tag = uuid.uuid4().hex[:8]
    handles = {}
    for kind in ("in", "out"):
        handle = shm.create_shared_memory_region(f"{kind}-{tag}", f"/bench-{kind}-{tag}", nbytes)
        cleanup.callback(shm.destroy_shared_memory_region, handle)
        client.register_system_shared_memory(f"{kind}-{tag}", f"/bench-{kind}-{tag}", nbytes)
        cleanup.callback(client.unregister_system_shared_memory, f"{kind}-{tag}")
        handles[kind] = handle

    def send(data: np.ndarray) -> np.ndarray:
        shm.set_shared_memory_region(handles["in"], [data])
        tensor = httpclient.InferInput("INPUT", list(data.shape), "FP32")
        tensor.set_shared_memory(f"in-{tag}", data.nbytes)
        output = httpclient.InferRequestedOutput("OUTPUT", binary_data=False)
        output.set_shared_memory(f"out-{tag}", data.nbytes)
        shape = client.infer(MODEL, [tensor], outputs=[output]).get_output("OUTPUT")["shape"]
        result: np.ndarray = shm.get_contents_as_numpy(handles["out"], np.float32, shape)
        return result

    return send


def measure(send: Request, data: np.ndarray, repeat: int, budget_s: float) -> list[float]:
    """Seconds per request: one checked warm-up, then up to ``repeat`` within ``budget_s``."""
    first = send(data)
    if not np.array_equal(first, data):
        raise AssertionError("the answer differs from the input")
    del first
    times: list[float] = []
    started = time.perf_counter()
    while len(times) < repeat and (len(times) < 2 or time.perf_counter() - started < budget_s):
        begin = time.perf_counter()
        result = send(data)
        times.append(time.perf_counter() - begin)
        del result
    return times


def run_paths(
    url: str, paths: list[str], sizes: list[int], repeat: int, budget_s: float
) -> dict[tuple[str, int], list[float]]:
    import tritonclient.http as httpclient

    address = url.removeprefix("http://").rstrip("/")
    results: dict[tuple[str, int], list[float]] = {}
    rng = np.random.default_rng(0)
    with httpclient.InferenceServerClient(
        address, connection_timeout=300, network_timeout=300
    ) as client:
        for size in sizes:
            data = rng.random(size * MB // 4, dtype=np.float32)
            for path in paths:
                with ExitStack() as cleanup:
                    if path == "shm":
                        send = shm_path(client, data.nbytes, cleanup)
                    else:
                        send = http_path(client, binary=path != "json")
                    times = measure(send, data, repeat, budget_s)
                results[(path, size)] = times
                p50 = statistics.median(times)
                print(
                    f"  {path:>12} {size:>3} MB: p50 {p50 * 1e3:8.1f} ms ({len(times)} requests)",
                    file=sys.stderr,
                )
    return results


def table(results: dict[tuple[str, int], list[float]], paths: list[str], sizes: list[int]) -> str:
    lines = [
        "| size | path | p50 latency ms | throughput MB/s | server-side copies |",
        "|---:|---|---:|---:|---|",
    ]
    for size in sizes:
        for path in paths:
            times = results.get((path, size))
            if not times:
                continue
            p50 = statistics.median(times)
            mean = statistics.fmean(times)
            copies = COPIES[path][0]
            if path in ("binary", "json") and size * MB <= THRESHOLD:
                copies = f"{COPIES['binary-redis'][0]} (not above the threshold: via Redis)"
            lines.append(f"| {size} MB | {path} | {p50 * 1e3:.1f} | {size / mean:.0f} | {copies} |")
    lines += ["", "Copies of the tensor bytes per request, counted from the code:", ""]
    lines += [
        f"- **{path}**: server: {COPIES[path][1]}. client: {COPIES[path][2]}." for path in paths
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.shm_bench", description=__doc__)
    parser.add_argument("--url", help="a running stack that serves the identity model")
    parser.add_argument("--write-repository", type=Path, help="write the repository and exit")
    parser.add_argument("--sizes", default="1,16,64", help="tensor sizes in MB")
    parser.add_argument("--paths", default="json,binary,shm")
    parser.add_argument("--redis-path", action="store_true", help="also binary-redis")
    parser.add_argument("--repeat", type=int, default=20, help="requests per cell at most")
    parser.add_argument("--budget", type=float, default=10.0, help="seconds per cell at most")
    args = parser.parse_args(argv)
    if args.write_repository:
        write_repository(args.write_repository)
        return 0
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    paths = [p for p in args.paths.split(",") if p.strip()]
    unknown = set(paths) - set(COPIES)
    if unknown:
        parser.error(f"unknown paths {sorted(unknown)}; choose from {sorted(COPIES)}")
    results: dict[tuple[str, int], list[float]] = {}
    if args.url:
        results = run_paths(args.url, paths, sizes, args.repeat, args.budget)
    else:
        with tempfile.TemporaryDirectory(prefix="shm-bench-") as tmp:
            repository = write_repository(Path(tmp))
            variants = [(paths, STACK_ENV)]
            if args.redis_path:
                variants.append(
                    (["binary-redis"], {**STACK_ENV, "SLUICE_SHM_THRESHOLD_BYTES": "0"})
                )
            for variant_paths, env in variants:
                stack = start_stack(repository, env=env)
                try:
                    assert stack.url is not None
                    print(f"stack at {stack.url} ({env})", file=sys.stderr)
                    wire = ["binary" if p == "binary-redis" else p for p in variant_paths]
                    found = run_paths(stack.url, wire, sizes, args.repeat, args.budget)
                    for (path, size), times in found.items():
                        name = "binary-redis" if variant_paths == ["binary-redis"] else path
                        results[(name, size)] = times
                finally:
                    stop_stack(stack)
        if args.redis_path:
            paths = [*paths, "binary-redis"]
    print(table(results, paths, sizes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
