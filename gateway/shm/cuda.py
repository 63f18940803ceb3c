"""Triton's CUDA shared memory extension: regions are CUDA IPC handles of client GPU memory.

Registering opens the handle with ``cudaIpcOpenMemHandle`` (cuda-python, imported only
here and only when a region is registered), which proves the handle and device are
valid; unregistering closes it. Without an NVIDIA GPU or cuda-python, registration
answers 501 and nothing else changes.
"""

from __future__ import annotations

import base64
import binascii
import ctypes
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from sluice.core.errors import InvalidInput, Unsupported

IPC_HANDLE_SIZE = 64
"""Bytes of a ``cudaIpcMemHandle_t`` (CUDA_IPC_HANDLE_SIZE)."""

UNAVAILABLE = (
    "CUDA shared memory needs an NVIDIA GPU and the cuda-python package (install sluice[gpu])"
)


@dataclass(frozen=True, slots=True)
class CudaRegion:
    name: str
    device_id: int
    byte_size: int
    pointer: int
    """Device address of the opened IPC handle in this process."""

    def status(self) -> dict[str, Any]:
        return {"name": self.name, "device_id": self.device_id, "byte_size": self.byte_size}


def decode_raw_handle(value: Any) -> bytes:
    """The handle bytes of a register body's ``raw_handle`` (``{"b64": "<base64>"}``)."""
    encoded = value.get("b64") if isinstance(value, dict) else None
    if not isinstance(encoded, str):
        raise InvalidInput('\'raw_handle\' must be an object {"b64": "<base64 handle>"}')
    try:
        raw = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidInput("'raw_handle.b64' is not valid base64") from None
    return checked_raw_handle(raw)


def checked_raw_handle(raw: bytes) -> bytes:
    """``raw`` when it has a CUDA IPC handle's size (gRPC sends the bytes themselves)."""
    if len(raw) != IPC_HANDLE_SIZE:
        raise InvalidInput(
            f"'raw_handle' holds {len(raw)} bytes; a CUDA IPC handle has {IPC_HANDLE_SIZE}"
        )
    return raw


def _runtime() -> ModuleType:
    try:
        import cuda.bindings.runtime as cudart  # cuda-python >= 12.6
    except ImportError:
        try:
            from cuda import cudart  # older cuda-python
        except ImportError:
            raise Unsupported(UNAVAILABLE) from None
    runtime: ModuleType = cudart  # (untyped in some cuda-python releases)
    return runtime


def _call(cudart: ModuleType, result: Any, what: str) -> Any:
    """The value of a cuda-python call (a tuple led by the error code), or raise."""
    error, *values = result if isinstance(result, tuple) else (result,)
    if error != cudart.cudaError_t.cudaSuccess:
        _, text = cudart.cudaGetErrorString(error)
        detail = text.decode() if isinstance(text, bytes) else str(text)
        raise InvalidInput(f"{what} failed: {detail}")
    return values[0] if len(values) == 1 else values


def open_cuda_region(name: str, raw_handle: bytes, device_id: int, byte_size: int) -> CudaRegion:
    """Errors start with Triton's text for them (GPUs not supported; invalid args)."""
    try:
        cudart = _runtime()
        error, count = cudart.cudaGetDeviceCount()
        if error != cudart.cudaError_t.cudaSuccess or count == 0:
            raise Unsupported(f"{UNAVAILABLE}: no usable CUDA device ({error})")
    except Unsupported as exc:
        raise Unsupported(
            f"failed to register CUDA shared memory region: '{name}', GPUs not supported: "
            f"{exc.message}"
        ) from None
    try:
        if not 0 <= device_id < count:
            raise InvalidInput(f"device_id {device_id} does not exist: this host has {count} GPUs")
        _call(cudart, cudart.cudaSetDevice(device_id), f"cudaSetDevice({device_id})")
        handle = cudart.cudaIpcMemHandle_t()
        ctypes.memmove(handle.getPtr(), raw_handle, IPC_HANDLE_SIZE)
        pointer = _call(
            cudart,
            cudart.cudaIpcOpenMemHandle(handle, cudart.cudaIpcMemLazyEnablePeerAccess),
            f"opening the CUDA IPC handle of region '{name}'",
        )
    except InvalidInput as exc:
        raise InvalidInput(
            f"failed to register shared memory region: invalid args: {exc.message}"
        ) from None
    return CudaRegion(name, device_id, byte_size, int(pointer))


def close_cuda_region(region: CudaRegion) -> None:
    cudart = _runtime()
    _call(cudart, cudart.cudaSetDevice(region.device_id), f"cudaSetDevice({region.device_id})")
    _call(
        cudart,
        cudart.cudaIpcCloseMemHandle(region.pointer),
        f"closing the CUDA IPC handle of region '{region.name}'",
    )
