"""``POST /wfpredict/{workflow}``: a TorchServe workflow run over its graph, each node a
prediction of its model (:func:`sluice.gateway.torchserve.routes.predict`), with
TorchServe's data flow:

- the start node receives the request's body with its content type (a multipart form's
  fields each as a part, as ``/predictions`` passes them);
- a node with one parent receives the parent's answer as its body, as bytes; a node with
  several receives one part per parent, named after it;
- nodes whose parents have all answered run at once, side by side;
- a node's call that fails or passes the node's ``timeout-ms`` is tried again, up to its
  ``retry-attempts`` more times; then the run fails with TorchServe's 500 naming the node
  (and, beyond TorchServe's text, why);
- the answer is the one leaf's answer, or with several leaves a JSON object of each leaf's
  answer by its name.

Every call goes through the model's queue as any prediction does: admission, the tenant's
limits, batching. A client that goes away cancels the calls still running.
"""

from __future__ import annotations

import asyncio
import json
import secrets
from collections.abc import Awaitable
from typing import Any

from fastapi import APIRouter, Request, Response

from sluice.core.errors import InferenceFailed, SluiceError
from sluice.core.war import Workflow, WorkflowNode
from sluice.gateway.http.body import read_body
from sluice.gateway.http.protocol import cancel_on_disconnect
from sluice.gateway.inference.data_plane import OFFLOAD_BYTES
from sluice.gateway.state import GatewayState, state_of
from sluice.gateway.torchserve.routes import DEFAULT_TYPE, error_response, predict
from sluice.gateway.torchserve.workflows import registered

router = APIRouter()

Answer = tuple[bytes, str]
"""A node's answer: its bytes and their content type."""


@router.post("/wfpredict/{name}")
async def wfpredict(request: Request, name: str) -> Response:
    state = state_of(request)
    try:
        workflow = await registered(state, name)
        body = await read_body(request, state.settings.max_body_bytes)
        content_type = request.headers.get("content-type", DEFAULT_TYPE)
        cancel_on_disconnect(request.scope)
        answer = await run(state, workflow, (body, content_type))
        return Response(answer, media_type="application/json")
    except SluiceError as exc:
        return error_response(exc)


async def run(state: GatewayState, workflow: Workflow, request: Answer) -> bytes:
    """Run ``workflow`` on ``request``; the answer TorchServe sends."""
    answers: dict[str, Answer] = {}
    waiting = {node: len(workflow.parents(node)) for node in workflow.nodes}
    running: dict[asyncio.Task[Answer], str] = {}

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
                for child in workflow.children[node]:
                    waiting[child] -= 1
                    if waiting[child] == 0:
                        start(child, await _input_of(workflow, child, answers))
    finally:
        for task in running:
            task.cancel()
        if running:
            await asyncio.gather(*running, return_exceptions=True)
    leaves = workflow.leaves
    if len(leaves) == 1:
        return answers[leaves[0]][0]
    return json.dumps({leaf: _value(answers[leaf][0]) for leaf in leaves}).encode()


async def _call(state: GatewayState, node: WorkflowNode, given: Answer) -> Answer:
    """One node's answer to ``given``, tried again as the node's settings say."""
    attempt = 0
    while True:
        try:
            call: Awaitable[Answer] = predict(state, node.model, None, *given)
            return await asyncio.wait_for(call, node.timeout_ms / 1000)
        except (SluiceError, TimeoutError) as exc:
            if attempt >= node.retry_attempts:
                why = exc.message if isinstance(exc, SluiceError) else "timed out"
                raise InferenceFailed(f"Error executing {node.name} ({why})") from None
            attempt += 1


async def _input_of(workflow: Workflow, node: str, answers: dict[str, Answer]) -> Answer:
    """What ``node`` receives: its one parent's answer as bytes, or a form of its parents'
    answers, one part each by the parent's name (built on a thread when large)."""
    parents = workflow.parents(node)
    if len(parents) == 1:
        return answers[parents[0]][0], DEFAULT_TYPE
    parts = [(parent, answers[parent][0]) for parent in parents]
    if sum(len(data) for _, data in parts) > OFFLOAD_BYTES:
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


def _value(data: bytes) -> Any:
    """A leaf's answer in the JSON of several: its JSON, else its text."""
    try:
        return json.loads(data)
    except ValueError:
        return data.decode(errors="replace")
