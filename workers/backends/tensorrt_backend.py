"""TensorRT backend (``platform: "tensorrt_plan"`` / ``backend: "tensorrt"``): ``model.plan``.

TensorRT 10's name-based API with cuda-python for device memory. Dynamic shapes
go through the engine's optimization profiles: each batch uses the first
profile whose [min, max] range holds every input shape. Device buffers are
kept per tensor and grow when a larger batch comes.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from sluice.core.config import ModelConfig
from sluice.core.errors import InferenceFailed, InvalidConfig, InvalidInput, Unsupported
from sluice.core.placement import Placement
from sluice.workers.backends.cuda_runtime import CudaRuntime, import_cudart


def _requirement(config: ModelConfig, missing: str) -> InvalidConfig:
    return InvalidConfig(
        f"model '{config.name}' needs TensorRT and an NVIDIA GPU: {missing} "
        "(install sluice[gpu] on a machine with an NVIDIA GPU)"
    )


def _import_tensorrt(config: ModelConfig) -> ModuleType:
    try:
        return importlib.import_module("tensorrt")
    except ImportError:
        raise _requirement(config, "the 'tensorrt' package is not installed") from None


def _runtime(config: ModelConfig, placement: Placement) -> tuple[CudaRuntime, int]:
    explicit_cpu = placement.kind != "KIND_GPU" and any(
        group.kind == "KIND_CPU" for group in config.instance_groups
    )
    if explicit_cpu:
        raise InvalidConfig(
            f"model '{config.name}': TensorRT engines run on GPUs only; "
            "instance_group kind KIND_CPU is not possible (use KIND_GPU)"
        )
    cudart = import_cudart()
    if cudart is None:
        raise _requirement(config, "the 'cuda-python' package is not installed")
    cuda = CudaRuntime(cudart)
    try:
        count = cuda.device_count()
    except InferenceFailed as exc:
        raise _requirement(config, f"no usable NVIDIA GPU ({exc.message})") from None
    device = placement.gpu or 0
    if count == 0:
        raise _requirement(config, "no NVIDIA GPU is visible")
    if device >= count:
        raise InvalidConfig(
            f"model '{config.name}' asks for GPU {device}, but only {count} GPU(s) are visible"
        )
    cuda.set_device(device)
    return cuda, device


@dataclass(slots=True)
class _Io:
    name: str
    is_input: bool
    dtype: np.dtype[Any]
    """Host dtype; BF16 tensors travel as their uint16 bit patterns."""
    bf16: bool
    pointer: int = 0
    capacity: int = 0


def _io_tensors(trt: ModuleType, engine: Any, config: ModelConfig) -> dict[str, _Io]:
    tensors: dict[str, _Io] = {}
    for index in range(engine.num_io_tensors):
        name = engine.get_tensor_name(index)
        if engine.is_shape_inference_io(name):
            raise Unsupported(f"model '{config.name}': shape tensor '{name}' is not supported")
        trt_dtype = engine.get_tensor_dtype(name)
        bf16 = trt_dtype == getattr(trt.DataType, "BF16", object())
        try:
            dtype = np.dtype(np.uint16) if bf16 else np.dtype(trt.nptype(trt_dtype))
        except TypeError:
            raise Unsupported(
                f"model '{config.name}': tensor '{name}' has TensorRT type {trt_dtype}, "
                "which has no numpy equivalent"
            ) from None
        is_input = engine.get_tensor_mode(name) == trt.TensorIOMode.INPUT
        tensors[name] = _Io(name, is_input, dtype, bf16)
    declared = {spec.name for spec in config.inputs}
    engine_inputs = {name for name, io in tensors.items() if io.is_input}
    if declared != engine_inputs:
        raise InvalidConfig(
            f"model '{config.name}': config inputs {sorted(declared)} differ from the "
            f"engine's inputs {sorted(engine_inputs)}"
        )
    unknown = [s.name for s in config.outputs if s.name not in tensors or tensors[s.name].is_input]
    if unknown:
        raise InvalidConfig(f"model '{config.name}': the engine has no output '{unknown[0]}'")
    return tensors


_Range = tuple[tuple[int, ...], tuple[int, ...]]


def _profiles(engine: Any, inputs: Sequence[str]) -> list[dict[str, _Range]]:
    """Per profile, each input's (min, max) shape."""
    profiles = []
    for profile in range(engine.num_optimization_profiles):
        ranges: dict[str, _Range] = {}
        for name in inputs:
            low, _opt, high = engine.get_tensor_profile_shape(name, profile)
            ranges[name] = (tuple(low), tuple(high))
        profiles.append(ranges)
    return profiles


def _fits(shape: tuple[int, ...], low: tuple[int, ...], high: tuple[int, ...]) -> bool:
    return len(shape) == len(low) and all(
        lo <= d <= hi for d, lo, hi in zip(shape, low, high, strict=True)
    )


class TensorRTBackend:
    def __init__(self, config: ModelConfig, model_path: Path, placement: Placement) -> None:
        trt = _import_tensorrt(config)
        self._cuda, self._device = _runtime(config, placement)
        if any(spec.datatype == "BYTES" for spec in (*config.inputs, *config.outputs)):
            raise InvalidConfig(f"model '{config.name}': TensorRT has no BYTES tensors")
        self._logger = trt.Logger(trt.Logger.WARNING)
        self._trt_runtime = trt.Runtime(self._logger)
        self._engine = self._trt_runtime.deserialize_cuda_engine(model_path.read_bytes())
        if self._engine is None:
            raise InvalidConfig(
                f"TensorRT cannot deserialize {model_path.name} (built by another TensorRT "
                "version or for another GPU?)"
            )
        self._context = self._engine.create_execution_context()
        self._tensors = _io_tensors(trt, self._engine, config)
        self._inputs = [name for name, io in self._tensors.items() if io.is_input]
        self._profiles = _profiles(self._engine, self._inputs)
        self._profile = 0
        self._stream = self._cuda.create_stream()
        self._name = config.name

    def _select_profile(self, shapes: Mapping[str, tuple[int, ...]]) -> None:
        for index, ranges in enumerate(self._profiles):
            if all(_fits(shapes[name], *ranges[name]) for name in self._inputs):
                if index != self._profile:
                    self._context.set_optimization_profile_async(index, self._stream)
                    self._profile = index
                return
        allowed = "; ".join(
            ", ".join(f"{name} {list(low)}..{list(high)}" for name, (low, high) in r.items())
            for r in self._profiles
        )
        given = ", ".join(f"{name} {list(shape)}" for name, shape in shapes.items())
        raise InvalidInput(
            f"input shapes ({given}) fit no optimization profile of the engine ({allowed})"
        )

    def _buffer(self, io: _Io, nbytes: int) -> int:
        if nbytes > io.capacity:
            if io.pointer:
                self._cuda.free(io.pointer)
                io.pointer, io.capacity = 0, 0
            io.pointer, io.capacity = self._cuda.malloc(nbytes), nbytes
            self._context.set_tensor_address(io.name, io.pointer)
        return io.pointer

    def _host_input(self, name: str, array: np.ndarray) -> np.ndarray:
        io = self._tensors[name]
        if io.bf16:
            bits = np.ascontiguousarray(array, dtype="<f4").view("<u4") >> 16
            return bits.astype(np.uint16)
        return np.ascontiguousarray(array, dtype=io.dtype)

    def infer(
        self,
        inputs: Mapping[str, np.ndarray],
        outputs: Sequence[str],
        request_sizes: Sequence[int] | None = None,
    ) -> dict[str, np.ndarray]:
        self._cuda.set_device(self._device)
        hosts = {name: self._host_input(name, inputs[name]) for name in self._inputs}
        self._select_profile({name: tuple(h.shape) for name, h in hosts.items()})
        for name, host in hosts.items():
            if not self._context.set_input_shape(name, host.shape):
                raise InvalidInput(f"input '{name}': TensorRT rejects shape {list(host.shape)}")
            pointer = self._buffer(self._tensors[name], host.nbytes)
            self._cuda.to_device(pointer, host.ctypes.data, host.nbytes, self._stream)
        results: dict[str, np.ndarray] = {}
        for name, io in self._tensors.items():
            if io.is_input:
                continue
            shape = tuple(self._context.get_tensor_shape(name))
            if any(d < 0 for d in shape):
                raise Unsupported(f"output '{name}' has a data-dependent shape {list(shape)}")
            host = np.empty(shape, dtype=io.dtype)
            self._buffer(io, host.nbytes)
            if name in outputs:
                results[name] = host
        if not self._context.execute_async_v3(self._stream):
            raise InferenceFailed(f"TensorRT could not run model '{self._name}'")
        for name, host in results.items():
            io = self._tensors[name]
            self._cuda.to_host(host.ctypes.data, io.pointer, host.nbytes, self._stream)
        self._cuda.synchronize(self._stream)
        return {name: self._host_output(name, host) for name, host in results.items()}

    def _host_output(self, name: str, host: np.ndarray) -> np.ndarray:
        if self._tensors[name].bf16:
            return (host.astype("<u4") << 16).view("<f4")
        return host

    def close(self) -> None:
        for io in self._tensors.values():
            if io.pointer:
                with contextlib.suppress(InferenceFailed):
                    self._cuda.free(io.pointer)
                io.pointer = 0
        with contextlib.suppress(InferenceFailed):
            self._cuda.destroy_stream(self._stream)
        del self._context, self._engine, self._trt_runtime
