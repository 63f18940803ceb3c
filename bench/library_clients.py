"""Closed-loop load through general-purpose asyncio HTTP clients, as a user's service would
call Sluice, instead of the bench's raw sockets:

- ``aiohttp``: one ``aiohttp.ClientSession`` posting the bench's pre-encoded body (the
  same bytes as the raw client's request) and reading the whole answer;
- ``tritonclient``: ``tritonclient.http.aio`` (itself on aiohttp), inputs set from numpy
  and outputs decoded to numpy for every request, as Triton's users call a server.

Both keep ``concurrency`` keep-alive connections; an answer that is not a 200 (aiohttp) or
lacks an output (tritonclient) counts as an error."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from bench.client import Target, model_path
from bench.loadgen import LoadResult, WindowHook, closed_loop_calls
from bench.payload import InferRequest, request_inputs, tensor_specs

CLIENTS = ("raw", "aiohttp", "tritonclient")

Call = Callable[[], Awaitable[str | None]]


async def closed_loop(
    client: str,
    target: Target,
    model: str,
    metadata: dict[str, Any],
    max_batch_size: int,
    request: InferRequest,
    batch: int,
    concurrency: int,
    duration: float,
    warmup: float,
    on_window: WindowHook | None,
) -> LoadResult:
    if client == "aiohttp":
        import aiohttp

        url = f"http://{target.host}:{target.port}{model_path(model, '/infer')}"
        head, _, body = request.raw.partition(b"\r\n\r\n")
        headers = _request_headers(head)
        connector = aiohttp.TCPConnector(limit=max(concurrency, 1))
        async with aiohttp.ClientSession(connector=connector) as session:

            async def post() -> str | None:
                async with session.post(url, data=body, headers=headers) as response:
                    answer = await response.read()
                    if response.status != 200:
                        return f"HTTP {response.status}: {answer[:300]!r}"
                    return None

            return await closed_loop_calls(post, concurrency, duration, warmup, on_window)
    if client == "tritonclient":
        call, close = _tritonclient_call(
            target, model, metadata, max_batch_size, request, batch, concurrency
        )
        try:
            return await closed_loop_calls(call, concurrency, duration, warmup, on_window)
        finally:
            await close()
    raise ValueError(f"unknown client {client!r}; expected one of {', '.join(CLIENTS)}")


def _request_headers(head: bytes) -> dict[str, str]:
    """The content headers of the pre-encoded request (aiohttp writes the rest itself)."""
    headers = {}
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.decode("latin-1").partition(":")
        if name.lower() in ("content-type", "inference-header-content-length"):
            headers[name] = value.strip()
    return headers


def _tritonclient_call(
    target: Target,
    model: str,
    metadata: dict[str, Any],
    max_batch_size: int,
    request: InferRequest,
    batch: int,
    concurrency: int,
) -> tuple[Call, Callable[[], Awaitable[None]]]:
    import tritonclient.http.aio as aioclient

    binary = request.mode == "binary"
    inputs = []
    for spec, array in request_inputs(metadata, max_batch_size, batch):
        tensor = aioclient.InferInput(spec.name, list(array.shape), spec.datatype)
        tensor.set_data_from_numpy(array, binary_data=binary)
        inputs.append(tensor)
    names = [spec.name for spec in tensor_specs(metadata, "outputs")]
    outputs = [aioclient.InferRequestedOutput(name, binary_data=binary) for name in names]
    client = aioclient.InferenceServerClient(
        f"{target.host}:{target.port}", conn_limit=max(concurrency, 1)
    )

    async def infer() -> str | None:
        result = await client.infer(model, inputs, outputs=outputs)
        missing = [name for name in names if result.as_numpy(name) is None]
        return f"missing outputs {missing}" if missing else None

    return infer, client.close
