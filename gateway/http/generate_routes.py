"""Triton's generate extension: ``POST /v2/models/{m}[/versions/{v}]/generate`` and
``/generate_stream``.

The request is one JSON object. Each of the model's inputs takes the value of the key
with its name (``text_input`` for a text model), or of the same key in ``parameters``; a
value is one element or an array of them, and its shape follows the input's dims (one
dimension of -1 takes the element count; a batching model gets a batch of 1). Other keys
and ``parameters`` go with the request as its parameters. The answer has ``model_name``,
``model_version`` and each output under its own name: one element as itself, several as
an array. ``/generate_stream`` sends the same answer as a server-sent event: one for a model
that answers once; one per response, as they come, for a decoupled model (whose requests
``/generate`` refuses with Triton's 501).
Errors before inference are ``{"error": ...}`` with the status, as on every route.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Callable
from typing import Any

import orjson
from fastapi import APIRouter, Request, Response
from fastapi.responses import StreamingResponse

from sluice.core.config import ModelConfig
from sluice.core.errors import InferenceFailed, InvalidInput, SluiceError
from sluice.core.wire import ReplyMessage
from sluice.gateway.body_budget import BodyReservation
from sluice.gateway.http.body import read_body
from sluice.gateway.http.json_body import json_object
from sluice.gateway.http.protocol import cancel_on_disconnect
from sluice.gateway.inference.data_plane import (
    Prepared,
    encode_reply,
    execute,
    execute_stream,
    parsed_heavily,
    prepare_with,
)
from sluice.gateway.inference.json_tensors import flatten
from sluice.gateway.inference.parsing import parse_infer_document
from sluice.gateway.inference.request import DEFAULT_LIMITS, InferRequest, RequestLimits
from sluice.gateway.state import state_of

router = APIRouter()

_RESERVED = ("parameters", "id")
_SSE = "text/event-stream; charset=utf-8"


def _shape(config: ModelConfig, name: str, dims: tuple[int, ...], count: int) -> list[int]:
    """The input's shape for ``count`` elements: the config's dims, one -1 taking what the
    fixed ones leave, and a batch of 1 for a batching model."""
    fixed = math.prod(d for d in dims if d != -1) if dims else 1
    free = [i for i, d in enumerate(dims) if d == -1]
    shape = list(dims) if dims else [1]
    if len(free) == 1 and fixed and count % fixed == 0:
        shape[free[0]] = count // fixed
    elif free:
        raise InvalidInput(
            f"input '{name}' of model '{config.name}' has dims {list(dims)}: the generate "
            "extension can fill one variable dimension only; use /infer"
        )
    return [1, *shape] if config.max_batch_size > 0 else shape


def generate_document(
    body: dict[str, Any], config: ModelConfig, limits: RequestLimits = DEFAULT_LIMITS
) -> dict[str, Any]:
    """The KServe v2 request document of a generate request. A value's nesting is flattened
    within ``limits.max_json_depth`` (as ``/infer``'s ``data`` is), never by recursion."""
    parameters = body.get("parameters", {})
    if not isinstance(parameters, dict):
        raise InvalidInput("'parameters' must be an object")
    names = {spec.name for spec in config.inputs}
    inputs = []
    for spec in config.inputs:
        if spec.name in body:
            value = body[spec.name]
        elif spec.name in parameters:
            value = parameters[spec.name]
        elif spec.optional:
            continue
        else:
            raise InvalidInput(
                f"generate request for model '{config.name}' has no value for input '{spec.name}'"
            )
        data = flatten(f"input '{spec.name}'", value, limits.max_json_depth)
        inputs.append(
            {
                "name": spec.name,
                "datatype": spec.datatype,
                "shape": _shape(config, spec.name, spec.dims, len(data)),
                "data": data,
            }
        )
    extra = {key: value for key, value in body.items() if key not in names and key not in _RESERVED}
    extra.update({k: v for k, v in parameters.items() if k not in names})
    document: dict[str, Any] = {"inputs": inputs}
    if extra:
        document["parameters"] = extra
    if "id" in body:
        document["id"] = body["id"]
    return document


def _answer(model: str, infer_json: bytes) -> bytes:
    response = orjson.loads(infer_json)
    answer: dict[str, Any] = {
        "model_name": model,
        "model_version": response.get("model_version", ""),
    }
    for output in response.get("outputs", []):
        data = output.get("data", [])
        answer[output["name"]] = data[0] if len(data) == 1 else data
    return orjson.dumps(answer)


async def _prepare(
    request: Request, model: str, version: str | None, reservation: BodyReservation
) -> tuple[Prepared, bool, Callable[[ReplyMessage, memoryview], bytes]]:
    """The prepared request, whether it is big, and how an answer becomes a generate one.
    The body counts in the process's ``reservation`` until the caller releases it."""
    state = state_of(request)
    body = await read_body(request, state.settings.max_body_bytes, reservation)
    big = parsed_heavily(body, None)

    def parse(config: ModelConfig) -> InferRequest:
        # On a thread past a few KiB of JSON, as a JSON /infer request's.
        document = generate_document(json_object(body), config, state.limits)
        # Triton's generate refuses no name starting with 'triton_' (as /infer does): such
        # a key goes to the model as a parameter like any other.
        parsed = parse_infer_document(document, memoryview(b""), config, state.limits, allowed=None)
        for output in parsed.outputs:
            # The generate answer is JSON only (as Triton's), whatever the request's
            # 'binary_data_output' says: it must not turn the answer into a 500.
            output.binary = False
        return parsed

    prepared = await prepare_with(state, model, version, parse, heavy=big)
    parsed, transfer = prepared.parsed, state.transfer

    def encode(reply: ReplyMessage, data: memoryview) -> bytes:
        content, json_length = encode_reply(transfer, model, reply, data, parsed.outputs, parsed.id)
        if json_length is not None:
            raise InferenceFailed(
                f"an output of model '{model}' cannot be written as JSON (bytes that are not "
                "UTF-8, or a number JSON cannot hold); use /infer with binary outputs"
            )
        return _answer(model, content)

    return prepared, big, encode


@router.post("/v2/models/{model}/generate")
@router.post("/v2/models/{model}/versions/{version}/generate")
async def generate(request: Request, model: str, version: str | None = None) -> Response:
    state = state_of(request)
    reservation = state.bodies.reservation()  # (the body is held until it is answered)
    try:
        prepared, big, encode = await _prepare(request, model, version, reservation)
        cancel_on_disconnect(request.scope)
        answer = await execute(state, prepared, big, encode)
    finally:
        reservation.release()
    return Response(answer, media_type="application/json")


@router.post("/v2/models/{model}/generate_stream")
@router.post("/v2/models/{model}/versions/{version}/generate_stream")
async def generate_stream(request: Request, model: str, version: str | None = None) -> Response:
    """One event per response; a decoupled model's come as it sends them, until its final
    one. An error after the stream began is an event ``{"error": ...}`` that ends it."""
    state = state_of(request)
    reservation = state.bodies.reservation()
    try:
        prepared, big, encode = await _prepare(request, model, version, reservation)
        # A client gone before the first response takes its request back, as on /generate
        # (a decoupled model's first response may be long in coming).
        cancel_on_disconnect(request.scope)
        if not prepared.decoupled:
            answer = await execute(state, prepared, big, encode)
            return Response(b"data: " + answer + b"\n\n", media_type=_SSE)
        responses = execute_stream(state, prepared, big, encode)
        # The first response (or the error before any) decides the status, as on /generate.
        first = await anext(responses, None)
    finally:
        # (A stream's body counts until its first response: its events are sent after this
        # handler returns, and may never be if the client is gone.)
        reservation.release()

    async def events() -> AsyncIterator[bytes]:
        try:
            if first is not None and first[1] is not None:
                yield b"data: " + first[1] + b"\n\n"
            async for _reply, answer in responses:
                if answer is not None:
                    yield b"data: " + answer + b"\n\n"
        except SluiceError as exc:
            yield b"data: " + orjson.dumps({"error": exc.message}) + b"\n\n"
        finally:
            await responses.aclose()

    return StreamingResponse(events(), media_type=_SSE)
