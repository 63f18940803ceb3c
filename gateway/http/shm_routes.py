"""The shared memory endpoints: ``/v2/systemsharedmemory/...`` and ``/v2/cudasharedmemory/...``.

Bodies and answers as Triton's, so ``tritonclient`` works unchanged:
register ``{"key", "offset", "byte_size"}`` (CUDA: ``{"raw_handle": {"b64"}, "device_id",
"byte_size"}``), unregister with an empty body (no region name: all regions), status as a
list of regions. The edge guard asks for an admin key here when admin keys are set.
Unregistering a region that requests in flight use answers at once, as Triton's does; the
region goes when the last of them ends (:mod:`sluice.gateway.shm.leases`).
"""

from __future__ import annotations

from typing import Any

import orjson
from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import Response

from sluice.core.errors import InvalidInput
from sluice.core.fields import json_type
from sluice.gateway.http.json_body import json_response
from sluice.gateway.shm.cuda import decode_raw_handle
from sluice.gateway.shm.registry import RegionRegistry
from sluice.gateway.state import state_of

shm_router = APIRouter()

_SYSTEM = "/v2/systemsharedmemory"
_CUDA = "/v2/cudasharedmemory"


def _registry(request: Request) -> RegionRegistry:
    registry: RegionRegistry = state_of(request).regions
    return registry


def _ok() -> Response:
    return Response(b"")


async def _register_body(request: Request, name: str) -> dict[str, Any]:
    body = await request.body()
    try:
        document = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise InvalidInput(f"register region '{name}': malformed JSON body: {exc}") from None
    if not isinstance(document, dict):
        raise InvalidInput(f"register region '{name}': the body must be a JSON object")
    return document


def _natural(document: dict[str, Any], field: str, name: str, default: int | None = None) -> int:
    value = document.get(field, default)
    if value is None:
        raise InvalidInput(f"Shared memory register request has no '{field}' field")
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidInput(
            f"register region '{name}': '{field}' must be a non-negative integer, got {value!r}"
        )
    return value


@shm_router.get(f"{_SYSTEM}/status")
async def system_status_all(request: Request) -> Response:
    return json_response(await _registry(request).system_status(None))


@shm_router.get(_SYSTEM + "/region/{name}/status")
async def system_status(request: Request, name: str) -> Response:
    return json_response(await _registry(request).system_status(name))


@shm_router.post(_SYSTEM + "/region/{name}/register")
async def system_register(request: Request, name: str) -> Response:
    document = await _register_body(request, name)
    key = document.get("key")
    if key is None:
        raise InvalidInput("Shared memory register request has no 'key' field")
    if not isinstance(key, str):
        raise InvalidInput(
            f"register region '{name}': 'key' must be a string, got {json_type(key)}"
        )
    offset = _natural(document, "offset", name, 0)
    byte_size = _natural(document, "byte_size", name)
    await _registry(request).register_system(name, key, offset, byte_size)
    return _ok()


@shm_router.post(f"{_SYSTEM}/unregister")
async def system_unregister_all(request: Request) -> Response:
    await _registry(request).unregister_system(None)
    return _ok()


@shm_router.post(_SYSTEM + "/region/{name}/unregister")
async def system_unregister(request: Request, name: str) -> Response:
    await _registry(request).unregister_system(name)
    return _ok()


@shm_router.get(f"{_CUDA}/status")
async def cuda_status_all(request: Request) -> Response:
    return json_response(await _registry(request).cuda_status(None))


@shm_router.get(_CUDA + "/region/{name}/status")
async def cuda_status(request: Request, name: str) -> Response:
    return json_response(await _registry(request).cuda_status(name))


@shm_router.post(_CUDA + "/region/{name}/register")
async def cuda_register(request: Request, name: str) -> Response:
    document = await _register_body(request, name)
    raw_handle = decode_raw_handle(document.get("raw_handle"))
    device_id = _natural(document, "device_id", name)
    byte_size = _natural(document, "byte_size", name)
    await _registry(request).register_cuda(name, raw_handle, device_id, byte_size)
    return _ok()


@shm_router.post(f"{_CUDA}/unregister")
async def cuda_unregister_all(request: Request) -> Response:
    await _registry(request).unregister_cuda(None)
    return _ok()


@shm_router.post(_CUDA + "/region/{name}/unregister")
async def cuda_unregister(request: Request, name: str) -> Response:
    await _registry(request).unregister_cuda(name)
    return _ok()
