"""The few CUDA runtime calls the TensorRT backend needs, through cuda-python."""

from __future__ import annotations

from types import ModuleType
from typing import Any, cast

from sluice.core.errors import InferenceFailed


def import_cudart() -> ModuleType | None:
    """cuda-python's runtime module (``cuda.bindings.runtime``, or ``cuda.cudart`` before 12.6)."""
    try:
        from cuda.bindings import runtime

        return cast(ModuleType, runtime)
    except ImportError:
        pass
    try:
        from cuda import cudart

        return cast(ModuleType, cudart)
    except ImportError:
        return None


class CudaRuntime:
    def __init__(self, cudart: ModuleType) -> None:
        self._rt = cudart

    def _check(self, call: str, result: Any) -> Any:
        """cuda-python returns ``(error, *values)``; raise on an error, return the values."""
        error, *values = result if isinstance(result, tuple) else (result,)
        if error != self._rt.cudaError_t.cudaSuccess:
            raise InferenceFailed(f"CUDA {call} failed: {getattr(error, 'name', error)}")
        return values[0] if len(values) == 1 else tuple(values)

    def device_count(self) -> int:
        return int(self._check("cudaGetDeviceCount", self._rt.cudaGetDeviceCount()))

    def set_device(self, index: int) -> None:
        self._check("cudaSetDevice", self._rt.cudaSetDevice(index))

    def create_stream(self) -> Any:
        return self._check("cudaStreamCreate", self._rt.cudaStreamCreate())

    def destroy_stream(self, stream: Any) -> None:
        self._check("cudaStreamDestroy", self._rt.cudaStreamDestroy(stream))

    def malloc(self, nbytes: int) -> int:
        return int(self._check("cudaMalloc", self._rt.cudaMalloc(max(1, nbytes))))

    def free(self, pointer: int) -> None:
        self._check("cudaFree", self._rt.cudaFree(pointer))

    def to_device(self, device: int, host: int, nbytes: int, stream: Any) -> None:
        kind = self._rt.cudaMemcpyKind.cudaMemcpyHostToDevice
        self._check("cudaMemcpyAsync", self._rt.cudaMemcpyAsync(device, host, nbytes, kind, stream))

    def to_host(self, host: int, device: int, nbytes: int, stream: Any) -> None:
        kind = self._rt.cudaMemcpyKind.cudaMemcpyDeviceToHost
        self._check("cudaMemcpyAsync", self._rt.cudaMemcpyAsync(host, device, nbytes, kind, stream))

    def synchronize(self, stream: Any) -> None:
        self._check("cudaStreamSynchronize", self._rt.cudaStreamSynchronize(stream))
