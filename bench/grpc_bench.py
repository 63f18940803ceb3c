"""``python -m bench.grpc_bench``: gRPC against REST binary, on one stack, in one run.

``sluice up`` with its defaults (every model of the example repository loaded) is started on
free HTTP and gRPC ports and stopped at the end. For each model (``mlp``, ``cnn``) and each
concurrency (1, 16, 64), the same batch-1 input (seeded, the model's input shape from its
metadata) goes through both wires, closed loop, 2 s warm-up then 10 s measured:

- ``rest``: Triton's binary tensor extension over keep-alive HTTP/1.1, the bench's own load
  generator (:func:`bench.loadgen.closed_loop`, one connection per worker);
- ``grpc``: ``tritonclient.grpc.aio.InferenceServerClient`` (one channel, or
  ``--grpc-channels`` clients on connections of their own, taken in turn) with
  ``InferInput.set_data_from_numpy`` (``raw_input_contents``), N coroutines looping ``infer``.

Every answer is checked against the model run in-process by onnxruntime on the same input
(names, datatypes, shapes, values); a wrong answer counts as an error, not a success. With
``--rounds`` above 1 every point is measured again with the wires in the other order
(drift of the machine falls on both alike) and the rounds are pooled. Prints a Markdown
report and writes it as JSON (``--out``). The load generator shares the machine's cores
with the stack; its CPU per request is reported beside the gateway's.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import itertools
import json
import os
import platform
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any, cast

import numpy as np
import orjson

from bench import loadgen
from bench.baseline import latest_model_file, make_session
from bench.client import Target, get_json, model_path, wait_until_ready
from bench.cpu import GROUPS, CpuMeter
from bench.payload import TensorSpec, build_request, numpy_dtype, request_inputs, tensor_specs
from bench.report import Point, summarize
from bench.stack import Stack, free_port, start_stack, stop_stack

WIRES = ("rest", "grpc")
RTOL, ATOL = 1e-4, 1e-5  # served against in-process outputs (batching may reorder sums)
MAX_KNOWN_ANSWERS = 16  # answer bytes already checked in full, compared as bytes after


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _ints(text: str) -> list[int]:
    values = [int(part) for part in text.split(",") if part.strip()]
    if not values or any(value < 1 for value in values):
        raise argparse.ArgumentTypeError("values must be positive")
    return values


def _names(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


# ----------------------------------------------------------------------------- answers


def compare(
    outputs: list[tuple[str, str, list[int], bytes]], expected: dict[str, np.ndarray]
) -> str | None:
    """``(name, datatype, shape, raw bytes)`` of each answered output against the reference."""
    names = [name for name, _, _, _ in outputs]
    if sorted(names) != sorted(expected):
        return f"outputs {names}, expected {sorted(expected)}"
    for name, datatype, shape, raw in outputs:
        want = expected[name]
        if numpy_dtype(datatype) != want.dtype:
            return f"output {name!r}: datatype {datatype}, expected {want.dtype}"
        if tuple(shape) != want.shape:
            return f"output {name!r}: shape {shape}, expected {list(want.shape)}"
        if len(raw) != want.nbytes:
            return f"output {name!r}: {len(raw)} bytes, expected {want.nbytes}"
        got = np.frombuffer(raw, dtype=want.dtype).reshape(want.shape)
        if not np.allclose(got, want, rtol=RTOL, atol=ATOL):
            worst = float(np.max(np.abs(got.astype(np.float64) - want)))
            return f"output {name!r}: differs from onnxruntime in-process by up to {worst:.3g}"
    return None


class Checker:
    """Checks answers in full against the reference; answers seen right before (as bytes)
    pass with a comparison of bytes, so that checking costs the load generator little."""

    def __init__(self, expected: dict[str, np.ndarray]) -> None:
        self.expected = expected
        self.known: set[bytes] = set()

    def _remember(self, key: bytes, problem: str | None) -> str | None:
        if problem is None and len(self.known) < MAX_KNOWN_ANSWERS:
            self.known.add(key)
        return problem

    def rest(self, body: bytes) -> str | None:
        """A binary-extension answer: a JSON header, then the outputs' bytes in its order."""
        if body in self.known:
            return None
        try:
            header, offset = json.JSONDecoder().raw_decode(body.decode("latin-1"))
            outputs = []
            for entry in header["outputs"]:
                size = int(entry["parameters"]["binary_data_size"])
                raw = body[offset : offset + size]
                outputs.append((entry["name"], entry["datatype"], entry["shape"], raw))
                offset += size
        except (ValueError, KeyError, TypeError) as exc:
            return f"unreadable answer ({exc}): {body[:200]!r}"
        if offset != len(body):
            return f"answer of {len(body)} bytes, its header accounts for {offset}"
        return self._remember(body, compare(outputs, self.expected))

    def grpc(self, response: Any) -> str | None:
        """A ``ModelInferResponse``: outputs described in ``outputs``, bytes in
        ``raw_output_contents``."""
        raw = response.raw_output_contents
        described = response.outputs
        if len(raw) != len(described):
            return f"{len(raw)} raw_output_contents for {len(described)} outputs"
        outputs = [
            (out.name, out.datatype, list(out.shape), data)
            for out, data in zip(described, raw, strict=True)
        ]
        key = orjson.dumps([[name, datatype, shape] for name, datatype, shape, _ in outputs])
        key += b"".join(raw)
        if key in self.known:
            return None
        return self._remember(key, compare(outputs, self.expected))


# ----------------------------------------------------------------------------- models


@dataclass
class Model:
    """One benchmarked model: its inputs (the same on both wires) and the expected answer."""

    name: str
    max_batch_size: int
    inputs: list[tuple[TensorSpec, np.ndarray]]
    outputs: list[TensorSpec]
    rest_request: bytes
    expected: dict[str, np.ndarray]


def reference(path: Path, inputs: list[tuple[TensorSpec, np.ndarray]]) -> dict[str, np.ndarray]:
    """The model's outputs for ``inputs``, in-process (the worker's session settings)."""
    session = make_session(path, 1)
    names = [node.name for node in session.get_outputs()]
    values = session.run(names, {spec.name: array for spec, array in inputs})
    return {name: np.asarray(value) for name, value in zip(names, values, strict=True)}


def prepare(target: Target, repository: Path, name: str) -> Model:
    metadata = get_json(target, model_path(name))
    max_batch = int(get_json(target, model_path(name, "/config")).get("max_batch_size", 0))
    inputs = request_inputs(metadata, max_batch, batch=1)
    request = build_request(target, name, metadata, max_batch, "binary", batch=1)
    if not request.raw.endswith(b"".join(array.tobytes() for _, array in inputs)):
        raise AssertionError("the REST request does not carry the gRPC request's inputs")
    outputs = tensor_specs(metadata, "outputs")
    expected = reference(latest_model_file(repository, name), inputs)
    return Model(name, max_batch, inputs, outputs, request.raw, expected)


# ----------------------------------------------------------------------------- load


async def rest_load(
    target: Target, model: Model, concurrency: int, args: argparse.Namespace, meter: CpuMeter
) -> loadgen.LoadResult:
    checker = Checker(model.expected)
    return await loadgen.closed_loop(
        target,
        model.rest_request,
        concurrency,
        args.duration,
        args.warmup,
        meter.on_window,
        check=checker.rest,
    )


async def grpc_load(
    address: str, model: Model, concurrency: int, args: argparse.Namespace, meter: CpuMeter
) -> loadgen.LoadResult:
    import tritonclient.grpc.aio as grpcclient

    checker = Checker(model.expected)
    inputs = []
    for spec, array in model.inputs:
        tensor = grpcclient.InferInput(spec.name, list(array.shape), spec.datatype)
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    outputs = [grpcclient.InferRequestedOutput(spec.name) for spec in model.outputs]
    # One client is one HTTP/2 connection (so one gateway process serves it all); with
    # --grpc-channels above 1, each client gets a connection of its own.
    channel_args = None if args.grpc_channels == 1 else _OWN_CONNECTION
    clients = [
        grpcclient.InferenceServerClient(address, channel_args=channel_args)
        for _ in range(args.grpc_channels)
    ]
    turns = itertools.cycle(clients)
    try:

        async def call() -> str | None:
            result = await next(turns).infer(model.name, inputs, outputs=outputs)
            return checker.grpc(result.get_response())

        return await loadgen.closed_loop_calls(
            call, concurrency, args.duration, args.warmup, meter.on_window
        )
    finally:
        for client in clients:
            await client.close()


_OWN_CONNECTION = [
    ("grpc.max_send_message_length", -1),
    ("grpc.max_receive_message_length", -1),
    ("grpc.use_local_subchannel_pool", 1),
]
"""tritonclient's own channel arguments, and a subchannel (connection) not shared with the
other clients of the process."""


@dataclass
class Measured:
    """One (model, wire, concurrency) point: its rounds, pooled."""

    model: str
    wire: str
    concurrency: int
    rounds: list[loadgen.LoadResult] = field(default_factory=list)
    cpu_seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(GROUPS, 0.0))

    def point(self) -> Point:
        pooled = loadgen.LoadResult(
            latencies=[latency for result in self.rounds for latency in result.latencies],
            errors=sum(result.errors for result in self.rounds),
            error_samples=[sample for result in self.rounds for sample in result.error_samples],
            elapsed=sum(result.elapsed for result in self.rounds),
        )
        return summarize("closed", self.wire, self.concurrency, pooled, 1, self.cpu_seconds, None)

    def round_rates(self) -> list[float]:
        return [len(result.latencies) / result.elapsed for result in self.rounds]


def measure_all(
    args: argparse.Namespace, stack: Stack, grpc_port: int, models: list[Model]
) -> list[Measured]:
    target = Target("127.0.0.1", stack.port)
    address = f"127.0.0.1:{grpc_port}"
    meter = CpuMeter(stack.pid)
    measured = {
        (model.name, wire, concurrency): Measured(model.name, wire, concurrency)
        for model in models
        for concurrency in args.concurrency
        for wire in args.wires
    }
    index = 0
    for round_index in range(args.rounds):
        for model in models:
            for concurrency in args.concurrency:
                wires = list(args.wires) if index % 2 == 0 else list(reversed(args.wires))
                index += 1
                for wire in wires:
                    meter.last = None
                    if wire == "rest":
                        result = loadgen.run(rest_load(target, model, concurrency, args, meter))
                    else:
                        result = loadgen.run(grpc_load(address, model, concurrency, args, meter))
                    entry = measured[(model.name, wire, concurrency)]
                    entry.rounds.append(result)
                    for group, seconds in (meter.last or dict.fromkeys(GROUPS, 0.0)).items():
                        entry.cpu_seconds[group] += seconds
                    p50, p99 = loadgen.percentiles_ms(result.latencies, (50.0, 99.0))
                    log(
                        f"round {round_index + 1} {model.name:4s} c={concurrency:<3d} "
                        f"{wire:4s}: {len(result.latencies) / result.elapsed:8,.0f} req/s, "
                        f"p50 {p50 or 0:7.2f} ms, p99 {p99 or 0:7.2f} ms, errors {result.errors}"
                    )
    return list(measured.values())


# ----------------------------------------------------------------------------- report


def _package(name: str) -> str:
    try:
        return version(name)
    except PackageNotFoundError:
        return "not installed"


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def commit() -> str | None:
    try:
        described = subprocess.run(
            ["git", "describe", "--always", "--dirty"],
            capture_output=True,
            text=True,
            check=True,
            cwd=Path(__file__).resolve().parent,
        )
    except (OSError, subprocess.CalledProcessError):
        return None
    return described.stdout.strip() or None


def environment() -> dict[str, Any]:
    return {
        "cpu_count": os.cpu_count(),
        "cpu_model": cpu_model(),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "grpcio": _package("grpcio"),
        "tritonclient": _package("tritonclient"),
        "onnxruntime": _package("onnxruntime"),
        "protobuf": _package("protobuf"),
        "uvloop": _package("uvloop"),
        "commit": commit(),
    }


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _us(point: Point, group: str) -> str:
    cpu = point.cpu_ms_per_request
    return "-" if cpu is None else f"{cpu[group] * 1000:.0f}"


def markdown(meta: dict[str, Any], measured: list[Measured]) -> str:
    env = meta["environment"]
    lines = [
        f"### gRPC against REST binary ({env['cpu_count']} cores, {env['cpu_model']}; "
        f"{meta['duration_s']:g} s per point after {meta['warmup_s']:g} s warm-up, "
        f"{meta['rounds']} round(s) pooled; "
        f"gRPC over {meta.get('grpc_channels', 1)} connection(s))",
        "",
        f"Python {env['python']}, grpcio {env['grpcio']}, tritonclient {env['tritonclient']}, "
        f"onnxruntime {env['onnxruntime']}, protobuf {env['protobuf']}, uvloop {env['uvloop']}."
        f" Stack: `{meta['stack_command']}`.",
        "",
        f"Command: `{meta['command']}`.",
        "",
        "| model | concurrency | wire | requests/s | requests/s per round | p50 ms | p99 ms "
        "| errors | gateway CPU µs/req | load generator CPU µs/req |",
        "| --- | ---: | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    points = {(m.model, m.wire, m.concurrency): (m, m.point()) for m in measured}
    for m, point in points.values():
        rounds = " / ".join(f"{rate:,.0f}" for rate in m.round_rates())
        lines.append(
            f"| {m.model} | {m.concurrency} | {m.wire} | {point.requests_per_s:,.0f} | {rounds} "
            f"| {_ms(point.p50_ms)} | {_ms(point.p99_ms)} | {point.errors} "
            f"| {_us(point, 'gateway')} | {_us(point, 'loadgen')} |"
        )
    if set(WIRES) <= set(meta["wires"]):
        lines += [
            "",
            "| model | concurrency | requests/s gRPC ÷ REST | p50 gRPC ÷ REST "
            "| p99 gRPC ÷ REST | gRPC at least as fast (requests/s) |",
            "| --- | ---: | ---: | ---: | ---: | --- |",
        ]
        for model in meta["models"]:
            for concurrency in meta["concurrency"]:
                rest_rounds, rest = points[(model, "rest", concurrency)]
                grpc_rounds, grpc = points[(model, "grpc", concurrency)]
                rate = grpc.requests_per_s / rest.requests_per_s if rest.requests_per_s else 0
                p50 = (grpc.p50_ms or 0) / (rest.p50_ms or 1)
                p99 = (grpc.p99_ms or 0) / (rest.p99_ms or 1)
                verdict = "yes" if rate >= 1.0 else "no"
                overlap = max(grpc_rounds.round_rates()) >= min(rest_rounds.round_rates())
                if rate < 1.0 and meta["rounds"] > 1 and overlap:
                    verdict = "no, within the spread of the rounds"
                lines.append(
                    f"| {model} | {concurrency} | {rate:.2f} | {p50:.2f} | {p99:.2f} | {verdict} |"
                )
    samples = [(m, s) for m, point in points.values() for s in point.error_samples[:2]]
    if samples:
        lines += ["", "First errors:", ""]
        lines += [f"- {m.model} {m.wire} c={m.concurrency}: `{s}`" for m, s in samples]
    return "\n".join(lines) + "\n"


def to_json(meta: dict[str, Any], measured: list[Measured]) -> dict[str, Any]:
    points = []
    for m in measured:
        entry = {"model": m.model, "wire": m.wire, **dataclasses.asdict(m.point())}
        entry["requests_per_s_per_round"] = m.round_rates()
        points.append(entry)
    return {"meta": meta, "points": points}


# ----------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.grpc_bench", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--models", type=_names, default=["mlp", "cnn"])
    parser.add_argument("--concurrency", type=_ints, default=[1, 16, 64])
    parser.add_argument("--wires", type=_names, default=list(WIRES), help="rest, grpc or both")
    parser.add_argument("--duration", type=float, default=10.0, help="measured seconds per point")
    parser.add_argument("--warmup", type=float, default=2.0, help="uncounted seconds per point")
    parser.add_argument(
        "--rounds", type=int, default=2, help="measurements per point, wires alternating order"
    )
    parser.add_argument(
        "--grpc-channels",
        type=int,
        default=1,
        help="gRPC clients (HTTP/2 connections) the calls take turns on (default 1)",
    )
    parser.add_argument(
        "--gateway-processes", help="sluice up's --gateway-processes (default: its own)"
    )
    parser.add_argument("--model-repository", type=Path, default=Path("model_repository"))
    parser.add_argument(
        "--out", type=Path, default=Path("bench/results/grpc-vs-rest.json"), help="JSON report"
    )
    args = parser.parse_args(argv)
    if not args.wires or set(args.wires) - set(WIRES):
        parser.error(f"--wires takes {', '.join(WIRES)}")
    if args.grpc_channels < 1:
        parser.error("--grpc-channels must be at least 1")
    if args.rounds < 1 or args.duration <= 0 or args.warmup < 0:
        parser.error("--rounds and --duration must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    grpc_port = free_port()
    stack_args = ["--grpc-port", str(grpc_port)]
    if args.gateway_processes:
        stack_args += ["--gateway-processes", args.gateway_processes]
    log(f"starting sluice up --model-repository {args.model_repository} (every model)")
    stack = start_stack(args.model_repository, free_port(), extra_args=stack_args)
    try:
        log(f"stack ready at {stack.url}, gRPC on port {grpc_port} (pid {stack.pid})")
        target = Target("127.0.0.1", stack.port)
        for name in args.models:
            wait_until_ready(target, name)
        models = [prepare(target, args.model_repository, name) for name in args.models]
        command = cast(list[str], stack.process.args)
        up = command[command.index("up") :]  # without the interpreter's path
        meta: dict[str, Any] = {
            "command": shlex.join(["python", "-m", "bench.grpc_bench", *sys.argv[1:]]),
            "stack_command": shlex.join(["sluice", *up]),
            "models": args.models,
            "wires": args.wires,
            "concurrency": args.concurrency,
            "duration_s": args.duration,
            "warmup_s": args.warmup,
            "rounds": args.rounds,
            "grpc_channels": args.grpc_channels,
            "batch": 1,
            "input_shapes": {m.name: [list(a.shape) for _, a in m.inputs] for m in models},
            "environment": environment(),
            "started_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        }
        measured = measure_all(args, stack, grpc_port, models)
    finally:
        log(f"stopping the stack (exit status {stop_stack(stack)})")
    text = markdown(meta, measured)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(to_json(meta, measured), indent=2) + "\n")
    log(f"wrote {args.out}")
    return 1 if any(m.point().errors for m in measured) else 0


if __name__ == "__main__":
    sys.exit(main())
