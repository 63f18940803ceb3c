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
import time
from collections.abc import Iterable

import orjson
from fastapi import APIRouter, Request, Response

from sluice.core.catalog import UNLOADED
from sluice.core.errors import Conflict, InferenceFailed, NotFound, SluiceError
from sluice.core.torchserve.workflows import (
    Workflow,
    WorkflowArchive,
    WorkflowNode,
    function_archive,
    parse_workflow,
)
from sluice.gateway.control.model_control import require_explicit
from sluice.gateway.http.json_body import json_response
from sluice.gateway.state import GatewayState
from sluice.gateway.torchserve.archives import Archive, archive_of, find_archive, find_workflow
from sluice.gateway.torchserve.management import (
    current_state,
    register_archive,
    registration,
    unload,
)
from sluice.gateway.torchserve.routes import error_response

log = logging.getLogger(__name__)

router = APIRouter()

MAX_LIST = 100
REGISTERING = "registering"
"""What a workflow's name holds while its nodes are registered (``registering <until>
<model>,<model>,...``: Unix seconds, and the models its nodes are registered as): the name
is claimed first, so that a registration of the same name through another gateway process
is refused before it registers (or, failing, unregisters) the same models. A claim outlives
its registration only when the process that made it died; once past its time another
registration takes the name over and unregisters the models the dead one may have left."""

_TAKE_OVER = """
if redis.call('HGET', KEYS[1], ARGV[1]) ~= ARGV[2] then return 0 end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[3])
return 1
"""
"""Replace a stale claim, unless another process replaced it first."""


def _text(raw: bytes | str) -> str:
    return raw.decode(errors="replace") if isinstance(raw, bytes) else raw


def _is_claim(raw: bytes | str) -> bool:
    return _text(raw).startswith(REGISTERING)


def _claim_lapsed(raw: bytes | str) -> bool:
    fields = _text(raw).split(" ")
    try:
        return float(fields[1]) < time.time()
    except (IndexError, ValueError):
        return True  # (a claim without its time: an older gateway's, long gone)


def _claimed_models(raw: bytes | str) -> list[str]:
    fields = _text(raw).split(" ")
    return [model for model in fields[2].split(",") if model] if len(fields) > 2 else []


async def _claim(state: GatewayState, workflow: Workflow) -> None:
    """Claim ``workflow``'s name for its registration (409, TorchServe's, when it is
    taken); a lapsed claim is taken over, and the models its registration left go."""
    key, name = state.keys.torchserve_workflows, workflow.name
    until = time.time() + 2 * state.settings.model_control_timeout_s + 60
    models = ",".join(node.model for node in workflow.nodes.values())
    claim = f"{REGISTERING} {until:.0f} {models}"
    if await state.redis.hsetnx(key, name, claim):
        return
    held = await state.redis.hget(key, name)
    taken = Conflict(f"Workflow {name} is already registered.")
    if held is None or not _is_claim(held) or not _claim_lapsed(held):
        raise taken
    if not await state.redis.eval(_TAKE_OVER, 1, key, name, held, claim):
        raise taken  # (another registration took it over first)
    log.warning("workflow %s: took over a registration that never ended", name)
    await _unregister_nodes(state, [m for m in _claimed_models(held) if _served(state, m)])


async def registered(state: GatewayState, name: str) -> Workflow:
    """The workflow registered as ``name``; TorchServe's 404 when there is none."""
    raw = await state.redis.hget(state.keys.torchserve_workflows, name)
    if raw is None or _is_claim(raw):
        raise NotFound(f"Workflow not found: {name}")
    return Workflow.from_json(raw)


@router.post("/workflows")
async def register(request: Request) -> Response:
    try:
        state, params, url = await registration(request)
        settings = state.settings
        store = settings.workflow_store or settings.model_store
        archive = await find_workflow(url, store, settings.allowed_model_urls)
        name = params.get("workflow_name")
        workflow = await asyncio.to_thread(parse_workflow, archive, url, name)
        key = state.keys.torchserve_workflows
        await _claim(state, workflow)
        try:
            await _register_nodes(state, workflow, archive, params)
        except BaseException:
            await state.redis.hdel(key, workflow.name)
            raise
        await state.redis.hset(key, workflow.name, workflow.to_json())
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
        done = [node.model for node, result in zip(nodes, results, strict=True) if result is None]
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
    _check_not_served(state, node)
    if node.url is None:
        url = f"{node.model}.mar"
        model = await asyncio.to_thread(_function_model, archive, node, url)
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
    response = await register_archive(state, asked, url, model, max_workers=node.max_workers)
    if response.status_code >= 300:
        raise InferenceFailed(bytes(response.body).decode(errors="replace"))


def _check_not_served(state: GatewayState, node: WorkflowNode) -> None:
    """A node's model is its workflow's own: one served already (registered by a client,
    or by another workflow whose name and node make the same ``<workflow>__<node>``) would
    get the node's archive as a version of its own, and go when the workflow goes."""
    if _served(state, node.model):
        raise Conflict(f"Model {node.model} is already registered.")


def _served(state: GatewayState, model: str) -> bool:
    entry = state.view.models.get(model)
    return bool(entry is not None and entry.error != UNLOADED and entry.versions and entry.config)


def _function_model(archive: WorkflowArchive, node: WorkflowNode, url: str) -> Archive:
    """The model archive serving function ``node``, made and read (work on a thread)."""
    return archive_of(function_archive(archive, node), url)


async def _unregister_nodes(state: GatewayState, models: Iterable[str]) -> list[str]:
    """Unregister each of a workflow's node ``models``; the failures, named."""
    failures = []
    for model in models:
        try:
            await unload(state, model)
        except SluiceError as exc:
            log.warning("unregistering workflow node %s failed: %s", model, exc.message)
            failures.append(f"Error while unregistering workflow node {model}")
    return failures


@router.get("/workflows")
async def list_workflows(request: Request) -> Response:
    try:
        state = await current_state(request)
        limit = _number(request, "limit", MAX_LIST)
        limit = MAX_LIST if not 0 <= limit <= MAX_LIST else limit
        token = max(0, _number(request, "next_page_token", 0))
        names = sorted(map(_text, await state.redis.hkeys(state.keys.torchserve_workflows)))
        page = names[token : token + limit]
        answer: dict[str, object] = {}
        if token + limit < len(names):
            answer["nextPageToken"] = str(token + limit)
        raw = await state.redis.hmget(state.keys.torchserve_workflows, page) if page else []
        answer["workflows"] = [
            {"workflowName": name, "workflowUrl": Workflow.from_json(data).url}
            for name, data in zip(page, raw, strict=True)
            if data is not None and not _is_claim(data)
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
        failures = await _unregister_nodes(state, (n.model for n in workflow.nodes.values()))
        if failures:
            raise InferenceFailed(
                f"Error while unregistering the workflow {name}. Details: {failures}"
            )
        return json_response({"status": f'Workflow "{name}" unregistered'})
    except SluiceError as exc:
        return error_response(exc)
