"""TorchServe's workflow management API (``sluice up --model-control-mode explicit``), with
TorchServe's answers:

- ``POST /workflows?url=...[&workflow_name=]``: register a workflow archive (.war, found
  as :func:`sluice.gateway.torchserve.archives.find_workflow` finds it) and every node of
  it, as a model ``<workflow>__<node>``: a model node from its archive (as
  ``POST /models?url=`` registers one, with the specification's batch size, batch delay
  and minimum workers), a function node as a TorchServe handler of the workflow's handler
  file. A node that fails unregisters those registered before it; the answer is 500
  naming each failure. ``response_timeout`` and ``startup_timeout`` apply to every node;
- ``GET /workflows[?limit=&next_page_token=]``: the registered workflows;
- ``GET /workflows/{name}``: its description (settings, and the DAG as TorchServe shows it);
- ``DELETE /workflows/{name}``: unregister it with its nodes.

A workflow is kept in Redis (:attr:`sluice.core.keys.Keys.torchserve_workflows`), so every
gateway process and host serves it; ``POST /wfpredict/{name}`` runs it
(:mod:`sluice.gateway.torchserve.workflow_run`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable

import orjson
from fastapi import APIRouter, Request, Response

from sluice.core.errors import Conflict, InferenceFailed, InvalidInput, NotFound, SluiceError
from sluice.core.war import (
    Workflow,
    WorkflowArchive,
    WorkflowNode,
    function_archive,
    parse_workflow,
)
from sluice.gateway.control.model_control import require_explicit
from sluice.gateway.http.json_body import json_response
from sluice.gateway.state import GatewayState
from sluice.gateway.torchserve.archives import archive_of, find_archive, find_workflow
from sluice.gateway.torchserve.management import (
    current_state,
    register_archive,
    register_params,
    unload,
)
from sluice.gateway.torchserve.routes import error_response

log = logging.getLogger(__name__)

router = APIRouter()

MAX_LIST = 100


async def registered(state: GatewayState, name: str) -> Workflow:
    """The workflow registered as ``name``; TorchServe's 404 when there is none."""
    raw = await state.redis.hget(state.keys.torchserve_workflows, name)
    if raw is None:
        raise NotFound(f"Workflow not found: {name}")
    return Workflow.from_json(raw)


@router.post("/workflows")
async def register(request: Request) -> Response:
    try:
        state = await current_state(request)
        await require_explicit(state)
        params = await register_params(request, state)
        url = params.get("url")
        if url is None:
            raise InvalidInput("Parameter url is required.")
        settings = state.settings
        store = settings.workflow_store or settings.model_store
        archive = await find_workflow(url, store, settings.allowed_model_urls)
        workflow = parse_workflow(archive, url, params.get("workflow_name"))
        key = state.keys.torchserve_workflows
        if await state.redis.hexists(key, workflow.name):
            raise Conflict(f"Workflow {workflow.name} is already registered.")
        await _register_nodes(state, workflow, archive, params)
        if not await state.redis.hsetnx(key, workflow.name, workflow.to_json()):
            await _unregister_nodes(state, workflow.nodes.values())  # (another won the name)
            raise Conflict(f"Workflow {workflow.name} is already registered.")
        message = f"Workflow {workflow.name} has been registered and scaled successfully."
        return json_response({"status": message})
    except SluiceError as exc:
        return error_response(exc)


async def _register_nodes(
    state: GatewayState, workflow: Workflow, archive: WorkflowArchive, params: dict[str, str]
) -> None:
    """Register every node at once; when any fails, unregister those that did not."""
    nodes = list(workflow.nodes.values())
    results = await asyncio.gather(
        *(_register_node(state, node, archive, params) for node in nodes),
        return_exceptions=True,
    )
    failures = [
        f"Workflow Node {node.model} failed to register. Details: {_reason(result)}"
        for node, result in zip(nodes, results, strict=True)
        if isinstance(result, BaseException)
    ]
    if failures:
        done = [node for node, result in zip(nodes, results, strict=True) if result is None]
        await _unregister_nodes(state, done)
        raise InferenceFailed(
            f"Workflow {workflow.name} has failed to register. Failures: [{', '.join(failures)}]"
        )


def _reason(error: BaseException) -> str:
    return error.message if isinstance(error, SluiceError) else type(error).__name__


async def _register_node(
    state: GatewayState, node: WorkflowNode, archive: WorkflowArchive, params: dict[str, str]
) -> None:
    settings = state.settings
    if node.url is None:
        url = f"{node.model}.mar"
        model = await asyncio.to_thread(archive_of, function_archive(archive, node), url)
    else:
        url = node.url
        model = await find_archive(url, settings.model_store, settings.allowed_model_urls)
    asked = {
        "model_name": node.model,
        "batch_size": str(node.batch_size),
        "max_batch_delay": str(node.max_batch_delay_ms),
        "initial_workers": str(node.min_workers),
        "synchronous": "true",
    }
    for name in ("response_timeout", "startup_timeout"):
        if name in params:
            asked[name] = params[name]
    response = await register_archive(state, asked, url, model)
    if response.status_code >= 300:
        raise InferenceFailed(bytes(response.body).decode(errors="replace"))


async def _unregister_nodes(state: GatewayState, nodes: Iterable[WorkflowNode]) -> list[str]:
    """Unregister each node's model; the failures, named."""
    failures = []
    for node in nodes:
        try:
            await unload(state, node.model)
        except SluiceError as exc:
            log.warning("unregistering workflow node %s failed: %s", node.model, exc.message)
            failures.append(f"Error while unregistering workflow node {node.model}")
    return failures


@router.get("/workflows")
async def list_workflows(request: Request) -> Response:
    try:
        state = await current_state(request)
        limit = _number(request, "limit", MAX_LIST)
        limit = MAX_LIST if not 0 <= limit <= MAX_LIST else limit
        token = max(0, _number(request, "next_page_token", 0))
        names = sorted(
            name.decode() if isinstance(name, bytes) else name
            for name in await state.redis.hkeys(state.keys.torchserve_workflows)
        )
        page = names[token : token + limit]
        answer: dict[str, object] = {}
        if token + limit < len(names):
            answer["nextPageToken"] = str(token + limit)
        raw = await state.redis.hmget(state.keys.torchserve_workflows, page) if page else []
        answer["workflows"] = [
            {"workflowName": name, "workflowUrl": Workflow.from_json(data).url}
            for name, data in zip(page, raw, strict=True)
            if data is not None
        ]
        return json_response(answer)
    except SluiceError as exc:
        return error_response(exc)


def _number(request: Request, name: str, default: int) -> int:
    """A query number as TorchServe reads one: its default when absent or not a number."""
    try:
        return int(request.query_params.get(name, default))
    except ValueError:
        return default


@router.get("/workflows/{name}")
async def describe(request: Request, name: str) -> Response:
    try:
        state = await current_state(request)
        workflow = await registered(state, name)
        settings = workflow.settings
        description = {
            "workflowName": workflow.name,
            "workflowUrl": workflow.url,
            "minWorkers": settings.get("min-workers", 1),
            "maxWorkers": settings.get("max-workers", 1),
            "batchSize": settings.get("batch-size", 1),
            "maxBatchDelay": settings.get("max-batch-delay", 50),
            "workflowDag": workflow.dag,
        }
        return Response(orjson.dumps([description]), media_type="application/json")
    except SluiceError as exc:
        return error_response(exc)


@router.delete("/workflows/{name}")
async def unregister(request: Request, name: str) -> Response:
    try:
        state = await current_state(request)
        await require_explicit(state)
        workflow = await registered(state, name)
        if not await state.redis.hdel(state.keys.torchserve_workflows, name):
            raise NotFound(f"Workflow not found: {name}")  # (another unregistered it)
        failures = await _unregister_nodes(state, workflow.nodes.values())
        if failures:
            raise InferenceFailed(
                f"Error while unregistering the workflow {name}. Details: {failures}"
            )
        return json_response({"status": f'Workflow "{name}" unregistered'})
    except SluiceError as exc:
        return error_response(exc)
