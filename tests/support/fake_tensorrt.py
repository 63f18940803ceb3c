"""Stand-ins for ``tensorrt`` and cuda-python, so the TensorRT backend's own logic (profiles,
buffers, copies, dtypes) runs on a machine without a GPU.

"Device memory" is host memory from ctypes, so the backend's copies are real
memmoves. The engine has input ``x`` FP32 [-1, 4] and output ``y = 2 * x``, with two
optimization profiles: batch 1..4 and batch 5..8.
"""

from __future__ import annotations

import ctypes
import enum
import sys
from types import ModuleType
from typing import Any

import numpy as np
import pytest

ENGINE_BYTES = b"FAKE-ENGINE"
PROFILES = (((1, 4), (2, 4), (4, 4)), ((5, 4), (6, 4), (8, 4)))


class _CudaError(enum.Enum):
    cudaSuccess = 0
    cudaErrorNoDevice = 100


class _MemcpyKind(enum.Enum):
    cudaMemcpyHostToDevice = 1
    cudaMemcpyDeviceToHost = 2


def cuda_runtime_module(device_count: int = 1) -> ModuleType:
    module = ModuleType("cuda.bindings.runtime")
    buffers: dict[int, Any] = {}
    ok = _CudaError.cudaSuccess

    def get_device_count() -> tuple[Any, int]:
        if device_count == 0:
            return _CudaError.cudaErrorNoDevice, 0
        return ok, device_count

    def malloc(nbytes: int) -> tuple[Any, int]:
        buffer = ctypes.create_string_buffer(nbytes)
        buffers[ctypes.addressof(buffer)] = buffer
        return ok, ctypes.addressof(buffer)

    def free(pointer: int) -> tuple[Any]:
        del buffers[pointer]
        return (ok,)

    def memcpy(dst: int, src: int, nbytes: int, kind: Any, stream: Any) -> tuple[Any]:
        ctypes.memmove(dst, src, nbytes)
        return (ok,)

    module.cudaError_t = _CudaError  # type: ignore[attr-defined]
    module.cudaMemcpyKind = _MemcpyKind  # type: ignore[attr-defined]
    module.cudaGetDeviceCount = get_device_count  # type: ignore[attr-defined]
    module.cudaSetDevice = lambda index: (ok,)  # type: ignore[attr-defined]
    module.cudaStreamCreate = lambda: (ok, "stream")  # type: ignore[attr-defined]
    module.cudaStreamDestroy = lambda stream: (ok,)  # type: ignore[attr-defined]
    module.cudaStreamSynchronize = lambda stream: (ok,)  # type: ignore[attr-defined]
    module.cudaMalloc = malloc  # type: ignore[attr-defined]
    module.cudaFree = free  # type: ignore[attr-defined]
    module.cudaMemcpyAsync = memcpy  # type: ignore[attr-defined]
    module.buffers = buffers  # type: ignore[attr-defined]
    return module


class DataType(enum.Enum):
    FLOAT = 0
    HALF = 1
    INT32 = 3
    BF16 = 7


class TensorIOMode(enum.Enum):
    INPUT = 1
    OUTPUT = 2


def nptype(dtype: DataType) -> type:
    types = {DataType.FLOAT: np.float32, DataType.HALF: np.float16, DataType.INT32: np.int32}
    if dtype not in types:
        raise TypeError(f"no numpy type for {dtype}")
    return types[dtype]


class Logger:
    WARNING = 2

    def __init__(self, level: int) -> None:
        self.level = level


class _Context:
    def __init__(self) -> None:
        self.profile = 0
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.addresses: dict[str, int] = {}
        self.runs: list[tuple[int, tuple[int, ...]]] = []

    def set_optimization_profile_async(self, index: int, stream: Any) -> bool:
        self.profile = index
        return True

    def set_input_shape(self, name: str, shape: tuple[int, ...]) -> bool:
        low, _, high = PROFILES[self.profile]
        if not all(lo <= d <= hi for d, lo, hi in zip(shape, low, high, strict=True)):
            return False
        self.shapes[name] = tuple(shape)
        return True

    def get_tensor_shape(self, name: str) -> tuple[int, ...]:
        return self.shapes["x"]

    def set_tensor_address(self, name: str, address: int) -> bool:
        self.addresses[name] = address
        return True

    def execute_async_v3(self, stream: Any) -> bool:
        shape = self.shapes["x"]
        count = int(np.prod(shape))
        x = np.ctypeslib.as_array((ctypes.c_float * count).from_address(self.addresses["x"]))
        y = np.ctypeslib.as_array((ctypes.c_float * count).from_address(self.addresses["y"]))
        y[:] = 2 * x
        self.runs.append((self.profile, shape))
        return True


class _Engine:
    num_io_tensors = 2
    num_optimization_profiles = len(PROFILES)

    def __init__(self) -> None:
        self.contexts: list[_Context] = []

    def get_tensor_name(self, index: int) -> str:
        return ("x", "y")[index]

    def get_tensor_mode(self, name: str) -> TensorIOMode:
        return TensorIOMode.INPUT if name == "x" else TensorIOMode.OUTPUT

    def get_tensor_dtype(self, name: str) -> DataType:
        return DataType.FLOAT

    def is_shape_inference_io(self, name: str) -> bool:
        return False

    def get_tensor_profile_shape(self, name: str, profile: int) -> tuple[tuple[int, ...], ...]:
        return PROFILES[profile]

    def create_execution_context(self) -> _Context:
        self.contexts.append(_Context())
        return self.contexts[-1]


class Runtime:
    engines: list[_Engine] = []

    def __init__(self, logger: Logger) -> None:
        self.logger = logger

    def deserialize_cuda_engine(self, data: bytes) -> _Engine | None:
        if data != ENGINE_BYTES:
            return None
        Runtime.engines.append(_Engine())
        return Runtime.engines[-1]


def tensorrt_module() -> ModuleType:
    module = ModuleType("tensorrt")
    for name in ("DataType", "TensorIOMode", "nptype", "Logger", "Runtime"):
        setattr(module, name, globals()[name])
    return module


def install(monkeypatch: pytest.MonkeyPatch, *, cuda: bool = True, devices: int = 1) -> None:
    """Make ``import tensorrt`` (and cuda-python, unless ``cuda`` is False) find the fakes."""
    Runtime.engines = []
    monkeypatch.setitem(sys.modules, "tensorrt", tensorrt_module())
    if not cuda:  # hidden, also where the real cuda-python is installed and imported
        for name in ("cuda", "cuda.bindings", "cuda.bindings.runtime", "cuda.cudart"):
            monkeypatch.setitem(sys.modules, name, None)
        return
    runtime = cuda_runtime_module(devices)
    bindings = ModuleType("cuda.bindings")
    bindings.runtime = runtime  # type: ignore[attr-defined]
    package = ModuleType("cuda")
    package.bindings = bindings  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "cuda", package)
    monkeypatch.setitem(sys.modules, "cuda.bindings", bindings)
    monkeypatch.setitem(sys.modules, "cuda.bindings.runtime", runtime)
