"""TorchServe's inference API beside the KServe v2 routes: ``POST /predictions/{model}
[/{version}]``, ``POST /explanations/{model}[/{version}]``, KServe v1's
``POST /v1/models/{model}:predict`` and ``:explain``, and ``GET /ping``.

The version is TorchServe's, by its exact text (``1.0``, not ``1``:
:mod:`sluice.core.torchserve.versions`). A prediction carries the request's body and
content type as the model's ``body`` and ``content_type`` BYTES inputs
(:mod:`sluice.workers.backends.torchserve_backend`): through the
same validation, admission, queue and batcher as a v2 request, so TorchServe's
``batch_size`` / ``max_batch_delay`` become Sluice's batching. An explanation is the same
call, marked for the handler (:mod:`sluice.core.torchserve.explanations`). The answer is the
handler's ``response`` with its ``response_type``, and the status the handler set for it
(:mod:`sluice.core.torchserve.statuses`); errors use TorchServe's body,
``{"code", "type", "message"}`` (its exception's name as the type:
:mod:`.exception_types`), and a model or a version TorchServe would not know is its 404
(``Model not found: m``, ``Model version: v does not exist for model: m``, a version that
is no number too). As TorchServe, the routes without a version read none from the query.
"""

from __future__ import annotations

import struct
from typing import Any, NamedTuple

from fastapi import APIRouter, Request, Response

from sluice.core.config import ModelConfig
from sluice.core.errors import InvalidInput, NotFound, SluiceError, Unavailable
from sluice.core.torchserve.explanations import EXPLAIN
from sluice.core.torchserve.statuses import reply_status
from sluice.core.wire import ReplyMessage
from sluice.gateway.control.catalog_follow import asked_fresh, follow_changes, is_problem
from sluice.gateway.control.catalog_view import NoReadyVersion
from sluice.gateway.control.inspection import server_not_ready
from sluice.gateway.http.body import read_body
from sluice.gateway.http.json_body import json_response
from sluice.gateway.http.protocol import cancel_on_disconnect
from sluice.gateway.inference.data_plane import OFFLOAD_BYTES, execute, prepare_with
from sluice.gateway.inference.parsing import parse_infer_document
from sluice.gateway.inference.request import InferRequest
from sluice.gateway.state import GatewayState, state_of
from sluice.gateway.torchserve.api_description import model_api
from sluice.gateway.torchserve.exception_types import exception_type
from sluice.gateway.torchserve.models import registered, version_number
from sluice.gateway.torchserve.ports import inference_path
from sluice.gateway.torchserve.route_docs import raw_body

router = APIRouter()

BODY, CONTENT_TYPE = "body", "content_type"
RESPONSE, RESPONSE_TYPE = "response", "response_type"
DEFAULT_TYPE = "application/octet-stream"


def error_response(error: SluiceError) -> Response:
    """TorchServe's error body, ``{"code", "type", "message"}``."""
    body = {"code": int(error.status), "type": exception_type(error), "message": error.message}
    return json_response(body, int(error.status))


def _element(value: bytes) -> bytes:
    """One BYTES element in Triton's binary layout (little-endian length, then the bytes)."""
    return struct.pack("<I", len(value)) + value


def _document(config: ModelConfig, body: bytes, content_type: bytes) -> dict[str, Any]:
    names = {spec.name for spec in config.inputs}
    if BODY not in names or CONTENT_TYPE not in names:
        raise InvalidInput(
            f"model '{config.name}' is not a TorchServe model (it takes no '{BODY}' and "
            f"'{CONTENT_TYPE}' inputs); call it at /v2/models/{config.name}/infer"
        )
    shape = [1, 1] if config.max_batch_size > 0 else [1]
    return {
        "inputs": [
            {
                "name": name,
                "datatype": "BYTES",
                "shape": shape,
                "parameters": {"binary_data_size": 4 + len(value)},
            }
            for name, value in ((BODY, body), (CONTENT_TYPE, content_type))
        ],
        "outputs": [
            {"name": name, "parameters": {"binary_data": True}}
            for name in (RESPONSE, RESPONSE_TYPE)
        ],
    }


def _first_element(data: bytes | memoryview) -> bytes:
    view = memoryview(data)
    if len(view) < 4:
        return b""
    (length,) = struct.unpack_from("<I", view)
    return bytes(view[4 : 4 + length])


@router.get("/ping")
async def ping(request: Request) -> Response:
    """TorchServe's health check: 200 ``Healthy`` once the gateway serves, else 500."""
    state = state_of(request)
    # (a process that has not yet seen what made the others ready looks again first)
    if await asked_fresh(state, lambda: server_not_ready(state), is_problem):
        return json_response({"status": "Unhealthy"}, 500)
    return json_response({"status": "Healthy"})


_PREDICTION_BODY = raw_body("The model's input, of any content type (its handler reads it)")
_EXPLANATION_BODY = raw_body("The input to explain, of any content type (its handler reads it)")


@router.post("/predictions/{model}", openapi_extra=_PREDICTION_BODY)
async def predictions(request: Request, model: str) -> Response:
    """The model's answer, by its default version."""
    return await _answer(request, model, None, explain=False)


@router.post("/predictions/{model}/{version}", openapi_extra=_PREDICTION_BODY)
async def version_predictions(request: Request, model: str, version: str) -> Response:
    return await _answer(request, model, version, explain=False)


@router.post("/explanations/{model}", openapi_extra=_EXPLANATION_BODY)
async def explanations(request: Request, model: str) -> Response:
    """The handler's explanation of the body (``explain_handle``) instead of its
    prediction."""
    return await _answer(request, model, None, explain=True)


@router.post("/explanations/{model}/{version}", openapi_extra=_EXPLANATION_BODY)
async def version_explanations(request: Request, model: str, version: str) -> Response:
    return await _answer(request, model, version, explain=True)


@router.post("/v1/models/{model}:predict", openapi_extra=_PREDICTION_BODY)
async def kserve_v1_predict(request: Request, model: str) -> Response:
    """KServe v1's prediction, as TorchServe serves it: the body goes to the handler as it
    is (a KServe handler reads its ``instances``)."""
    return await _answer(request, model, None, explain=False)


@router.post("/v1/models/{model}:explain", openapi_extra=_EXPLANATION_BODY)
async def kserve_v1_explain(request: Request, model: str) -> Response:
    """KServe v1's explanation, as TorchServe serves it."""
    return await _answer(request, model, None, explain=True)


async def _answer(request: Request, model: str, version: str | None, explain: bool) -> Response:
    state = state_of(request)
    reservation = state.bodies.reservation()  # (the body is held until it is answered)
    try:
        body = await read_body(request, state.settings.max_body_bytes, reservation)
        content_type = request.headers.get("content-type", DEFAULT_TYPE)
        cancel_on_disconnect(request.scope)
        answer = await predict_answer(state, model, version, body, content_type, explain=explain)
        return Response(answer.body, answer.status, media_type=answer.media)
    except SluiceError as exc:
        return error_response(exc)
    finally:
        reservation.release()


class HandlerAnswer(NamedTuple):
    """A handler's answer to one request."""

    body: bytes
    media: str
    """Its content type."""
    status: int
    """The status the handler set for it (200 when none)."""


async def predict(
    state: GatewayState,
    model: str,
    version: str | None,
    body: bytes,
    content_type: str,
    *,
    explain: bool = False,
) -> tuple[bytes, str]:
    """What TorchServe model ``model`` answers ``body`` of ``content_type`` (its explanation
    with ``explain``): the handler's response and its content type (a workflow's step:
    :mod:`.workflow_run`). ``version``: as TorchServe names it (``1.0``)."""
    answer = await predict_answer(state, model, version, body, content_type, explain=explain)
    return answer.body, answer.media


async def predict_answer(
    state: GatewayState,
    model: str,
    version: str | None,
    body: bytes,
    content_type: str,
    *,
    explain: bool = False,
) -> HandlerAnswer:
    """:func:`predict`'s answer, with the status the handler set for it."""
    kind = content_type.encode("latin-1")
    big = len(body) > OFFLOAD_BYTES

    def parse(config: ModelConfig) -> InferRequest:
        # On a thread when the body is big: the tensors are a copy of it.
        document = _document(config, body, kind)
        binary = memoryview(_element(body) + _element(kind))
        parsed = parse_infer_document(document, binary, config, state.limits, state.regions)
        if explain:
            parsed.parameters[EXPLAIN] = True
        return parsed

    number = await _served_version(state, model, version)
    try:
        prepared = await prepare_with(state, model, number, parse, heavy=big)
    except NoReadyVersion as exc:  # (registered, no version loaded: TorchServe's 503)
        registered(state, model)
        raise Unavailable(exc.message) from None
    except (NotFound, Unavailable):
        registered(state, model)  # (TorchServe's 404 when it is not registered at all)
        raise
    transfer = state.transfer
    outputs = prepared.parsed.outputs

    def encode(reply: ReplyMessage, data: memoryview) -> HandlerAnswer:
        tensors = {t.name: t for t in transfer.unpack(reply.outputs, data, outputs)}
        answer = tensors.get(RESPONSE)
        kind = tensors.get(RESPONSE_TYPE)
        media = _first_element(kind.data).decode("latin-1") if kind else DEFAULT_TYPE
        status = reply_status(reply.parameters) if reply.parameters else 200
        return HandlerAnswer(_first_element(answer.data) if answer else b"", media, status)

    return await execute(state, prepared, big, encode)


async def _served_version(state: GatewayState, model: str, version: str | None) -> str | None:
    """The number a TorchServe version (``1.0``) is served under; TorchServe's 404 for a
    model or a version it does not serve."""
    if version is None:
        return None
    await follow_changes(state)  # (a version another gateway process just registered)
    return str(version_number(registered(state, model), version))


@router.options("/predictions/{model}")
@router.options("/explanations/{model}")
async def model_description(request: Request, model: str) -> Response:
    """TorchServe's description of one model's inference API."""
    return await _described(request, model, None)


@router.options("/predictions/{model}/{version}")
@router.options("/explanations/{model}/{version}")
async def version_description(request: Request, model: str, version: str) -> Response:
    """The same, for a version of the model (404 when it has no such version)."""
    return await _described(request, model, version)


async def _described(request: Request, model: str, version: str | None) -> Response:
    try:
        document = await model_api(request, inference_path, model, version, "RESTful API for: ")
    except SluiceError as exc:
        return error_response(exc)
    return Response(document, media_type="application/json")
