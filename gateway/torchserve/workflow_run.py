"""``POST /wfpredict/{workflow}``: a TorchServe workflow run over its graph, each node a
prediction of its model (:func:`sluice.gateway.torchserve.routes.predict`), with
TorchServe's data flow:

- the start node receives the request's body with its content type (a multipart form's
  fields each as a part, as ``/predictions`` passes them);
- a node with one parent receives the parent's answer as its body, as bytes; a node with
  several receives one part per parent, named after it;
- nodes whose parents have all answered run at once, side by side;
- a node's call that fails on the server's side (5xx) or passes the node's ``timeout-ms``
  is tried again, up to its ``retry-attempts`` more times; then the run fails with
  TorchServe's 500 naming the node (and, beyond TorchServe's text, why). The node's
  handler failing is such a failure whatever its code (a ``PredictionException(msg,
  422)`` as well: TorchServe's workflow takes any error its worker reports for the node's
  failure). A client's error (a model gone, a tenant's limit: 4xx) and a model's refusal
  for a full queue (503: retry later) fail the run at once with their status;
- a status a node's handler sets for its answer (``context.set_response_status``) is not
  the run's, as in TorchServe (whose workflow takes the node's body alone): the answer
  goes on to the node's children, or is the run's answer, with 200;
- the answer is the one leaf's answer, or with several leaves a JSON object of each leaf's
  answer by its name (as it came where it is JSON, else as text). What a node is given,
  and the answers of several leaves together, are at most what a request's body may be.

Every call goes through the model's queue as any prediction does: admission, the tenant's
limits, batching. A client that goes away cancels the calls still running.
"""

from __future__ import annotations

import asyncio
import json
import secrets
from collections.abc import Awaitable

from fastapi import APIRouter, Request, Response

from sluice.core.errors import (
    HandlerFailed,
    InferenceFailed,
    Overloaded,
    PayloadTooLarge,
    SluiceError,
    error_from_kind,
    error_kind,
)
from sluice.core.torchserve.workflows import Workflow, WorkflowNode
from sluice.gateway.http.body import read_body
from sluice.gateway.http.protocol import cancel_on_disconnect
from sluice.gateway.inference.data_plane import OFFLOAD_BYTES
from sluice.gateway.state import GatewayState, state_of
from sluice.gateway.torchserve.route_docs import raw_body
from sluice.gateway.torchserve.routes import DEFAULT_TYPE, error_response, predict
from sluice.gateway.torchserve.workflows import registered

router = APIRouter()

Answer = tuple[bytes, str]
"""A node's answer: its bytes and their content type."""


@router.post(
    "/wfpredict/{name}",
    openapi_extra=raw_body("The workflow's input, of any content type (its first nodes read it)"),
)
async def wfpredict(request: Request, name: str) -> Response:
    state = state_of(request)
    reservation = state.bodies.reservation()  # (the body is held until the run ends)
    try:
        workflow = await registered(state, name)
        body = await read_body(request, state.settings.max_body_bytes, reservation)
        content_type = request.headers.get("content-type", DEFAULT_TYPE)
        cancel_on_disconnect(request.scope)
        answer = await run(state, workflow, (body, content_type))
        return Response(answer, media_type="application/json")
    except SluiceError as exc:
        return error_response(exc)
    finally:
        reservation.release()


async def run(state: GatewayState, workflow: Workflow, request: Answer) -> bytes:
    """Run ``workflow`` on ``request``; the answer TorchServe sends."""
    answers: dict[str, Answer] = {}
    waiting = {node: len(workflow.parents(node)) for node in workflow.nodes}
    running: dict[asyncio.Task[Answer], str] = {}
    limit = state.settings.max_body_bytes
    merged_leaves = len(workflow.leaves) > 1
    leaves_size = 0

    def start(node: str, given: Answer) -> None:
        call = _call(state, workflow.nodes[node], given)
        running[asyncio.create_task(call)] = node

    start(workflow.start, request)
    try:
        while running:
            done, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                node = running.pop(task)
                answers[node] = task.result()
                if merged_leaves and not workflow.children[node]:
                    leaves_size += len(answers[node][0])
                    if leaves_size > limit:
                        raise _leaves_too_large(leaves_size, limit)
                for child in workflow.children[node]:
                    waiting[child] -= 1
                    if waiting[child] == 0:
                        start(child, await _input_of(workflow, child, answers, limit))
                        _forget_answered(workflow, answers, waiting)
    finally:
        for task in running:
            task.cancel()
        if running:
            await asyncio.gather(*running, return_exceptions=True)
    return await _answer(workflow, answers)


def _leaves_too_large(size: int, limit: int) -> PayloadTooLarge:
    """The leaves' answers are merged into one JSON object, each parsed to see whether it
    is JSON (a parse that takes many times the bytes it reads): as a node's input, no more
    than a client's body may be."""
    return PayloadTooLarge(
        f"the workflow's leaves answered {size} bytes, more than a request's body may hold "
        f"({limit}), and their answer is one JSON object of all of them"
    )


def _forget_answered(
    workflow: Workflow, answers: dict[str, Answer], waiting: dict[str, int]
) -> None:
    """Drop each answer every child of its node has been given (a leaf's is the run's)."""
    for node in list(answers):
        kids = workflow.children[node]
        if kids and all(waiting[kid] == 0 for kid in kids):
            del answers[node]


async def _call(state: GatewayState, node: WorkflowNode, given: Answer) -> Answer:
    """One node's answer to ``given`` (the status its handler set dropped, as TorchServe
    drops it), tried again as the node's settings say when the call fails on the server's
    side, its handler fails (whatever its code), or it times out (as TorchServe, which does
    not try again a model that is not found); a client's error (4xx) fails at once, with
    its status, and so does a refusal for a full queue (tried again at once, it would only
    be refused again and add to the load: the client is told to retry later)."""
    attempt = 0
    while True:
        try:
            call: Awaitable[Answer] = predict(state, node.model, None, *given)
            return await asyncio.wait_for(call, node.timeout_ms / 1000)
        except (SluiceError, TimeoutError) as exc:
            final = isinstance(exc, SluiceError) and _not_the_node_s(exc)
            if final or attempt >= node.retry_attempts:
                raise _node_failed(node, exc) from None
            attempt += 1


def _not_the_node_s(exc: SluiceError) -> bool:
    """Whether ``exc`` is no failure of the node's own, and fails the run with its status:
    a client's error (4xx) or admission's refusal (a full queue, a gateway holding all it
    may: the call never ran). A handler's failure is the node's, whatever its code."""
    if isinstance(exc, HandlerFailed):
        return False
    return exc.status < 500 or isinstance(exc, Overloaded)


def _node_failed(node: WorkflowNode, exc: SluiceError | TimeoutError) -> SluiceError:
    """TorchServe's ``Error executing <node>`` (500), with why; a client's error and a
    refusal for load keep their kind."""
    if not isinstance(exc, SluiceError):
        return InferenceFailed(f"Error executing {node.name} (timed out)")
    message = f"Error executing {node.name} ({exc.message})"
    if _not_the_node_s(exc):
        return error_from_kind(error_kind(exc), message)
    return InferenceFailed(message)


async def _input_of(
    workflow: Workflow, node: str, answers: dict[str, Answer], limit: int
) -> Answer:
    """What ``node`` receives: its one parent's answer as bytes, or a form of its parents'
    answers, one part each by the parent's name (built on a thread when large); no more
    than a client's body may be (``limit``)."""
    parents = workflow.parents(node)
    size = sum(len(answers[parent][0]) for parent in parents)
    if size > limit:
        raise PayloadTooLarge(
            f"Error executing {node} (its parents answered {size} bytes, more than a "
            f"request's body may hold, {limit})"
        )
    if len(parents) == 1:
        return answers[parents[0]][0], DEFAULT_TYPE
    parts = [(parent, answers[parent][0]) for parent in parents]
    if size > OFFLOAD_BYTES:
        return await asyncio.to_thread(form, parts)
    return form(parts)


def form(parts: list[tuple[str, bytes]]) -> Answer:
    """A ``multipart/form-data`` body of ``parts`` (name, bytes), each as bytes."""
    boundary = secrets.token_hex(16)
    while any(boundary.encode() in data for _, data in parts):
        boundary = secrets.token_hex(16)
    chunks: list[bytes] = []
    for name, data in parts:
        head = (
            f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"\r\n'
            f"Content-Type: {DEFAULT_TYPE}\r\n\r\n"
        )
        chunks += [head.encode(), data, b"\r\n"]
    chunks.append(f"--{boundary}--\r\n".encode())
    return b"".join(chunks), f"multipart/form-data; boundary={boundary}"


async def _answer(workflow: Workflow, answers: dict[str, Answer]) -> bytes:
    """The one leaf's answer, or the JSON object of every leaf's (made on a thread when
    large)."""
    leaves = workflow.leaves
    if len(leaves) == 1:
        return answers[leaves[0]][0]
    parts = {leaf: answers[leaf][0] for leaf in leaves}
    if sum(len(data) for data in parts.values()) > OFFLOAD_BYTES:
        return await asyncio.to_thread(merged, parts)
    return merged(parts)


def merged(parts: dict[str, bytes]) -> bytes:
    """A JSON object of each leaf's answer by the leaf's name: the answer as it came where
    it is JSON (no number rounded, no key dropped), else its text as a JSON string."""
    members = [
        json.dumps(leaf).encode() + b": " + _value(leaf, data) for leaf, data in parts.items()
    ]
    return b"{" + b", ".join(members) + b"}"


def _value(leaf: str, data: bytes) -> bytes:
    """A leaf's answer in the JSON of several: its JSON, else its text; an answer that is
    not even text would be changed: the run fails, as TorchServe's does."""
    try:
        text = data.decode()
    except UnicodeDecodeError:
        raise InferenceFailed(
            f"Error executing {leaf} (its answer is neither JSON nor UTF-8 text, and the "
            "answer of several leaves is a JSON object)"
        ) from None
    try:
        json.loads(text, parse_constant=_no_constant)
    except (ValueError, RecursionError):
        return json.dumps(text).encode()
    return data


def _no_constant(name: str) -> None:
    """``NaN``, ``Infinity``: Python reads them, JSON has none."""
    raise ValueError(f"{name} is not JSON")
