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
from sluice.core.errors import Conflict, InferenceFailed, SluiceError
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
from sluice.gateway.torchserve.exception_types import WorkflowNotFound
from sluice.gateway.torchserve.management import (
    PAGES,
    current_state,
    register_archive,
    registration,
    unload,
)
from sluice.gateway.torchserve.route_docs import json_body, query
from sluice.gateway.torchserve.routes import error_response

log = logging.getLogger(__name__)

router = APIRouter()

MAX_LIST = 100
REGISTERING = "registering"
"""What a workflow's name holds while its nodes are registered or unregistered
(``registering <until> <model>,<model>,...``: Unix seconds, and the models its nodes are
registered as): the name is claimed first, so that a registration of the same name through
another gateway process is refused before it registers (or, failing, unregisters) the same
models, and the workflow runs no more once its unregistration begins. A claim outlives its
registration or unregistration only when the process that made it died (or stopped it);
once past its time another registration takes the name over and unregisters the models
the dead one may have left."""

_TAKE_OVER = """
if redis.call('HGET', KEYS[1], ARGV[1]) ~= ARGV[2] then return 0 end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[3])
return 1
"""
"""Replace a name's value (a stale claim, a workflow), unless another process replaced it
first."""

_FORGET = """
if redis.call('HGET', KEYS[1], ARGV[1]) ~= ARGV[2] then return 0 end
return redis.call('HDEL', KEYS[1], ARGV[1])
"""
"""Drop a name's claim, unless another process took it over meanwhile."""


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


def _claim_of(state: GatewayState, workflow: Workflow) -> str:
    """The claim on ``workflow``'s name while its nodes are registered or unregistered (at
    once: each within the model control's time)."""
    until = time.time() + 2 * state.settings.model_control_timeout_s + 60
    models = ",".join(node.model for node in workflow.nodes.values())
    return f"{REGISTERING} {until:.0f} {models}"


async def _claim(state: GatewayState, workflow: Workflow) -> str:
    """Claim ``workflow``'s name for its registration (409, TorchServe's, when it is
    taken); a lapsed claim is taken over, and the models its registration left go. The
    claim."""
    key, name = state.keys.torchserve_workflows, workflow.name
    claim = _claim_of(state, workflow)
    if await state.redis.hsetnx(key, name, claim):
        return claim
    held = await state.redis.hget(key, name)
    taken = Conflict(f"Workflow {name} is already registered.")
    if held is None or not _is_claim(held) or not _claim_lapsed(held):
        raise taken
    if not await state.redis.eval(_TAKE_OVER, 1, key, name, held, claim):
        raise taken  # (another registration took it over first)
    log.warning("workflow %s: took over a registration that never ended", name)
    await _unregister_nodes(state, [m for m in _claimed_models(held) if _served(state, m)])
    return claim


async def registered(state: GatewayState, name: str) -> Workflow:
    """The workflow registered as ``name``; TorchServe's 404 when there is none."""
    raw = await state.redis.hget(state.keys.torchserve_workflows, name)
    if raw is None or _is_claim(raw):
        raise WorkflowNotFound(f"Workflow not found: {name}")
    return Workflow.from_json(raw)


_REGISTRATION = {
    **query(
        url=("string", "The workflow archive: a file of the store, or an allowed URL (required)"),
        workflow_name=("string", "The workflow's name, instead of the archive's"),
        response_timeout=("integer", "Seconds an inference of a node's model may take"),
        startup_timeout=("integer", "Seconds the workers of a node's model may take to start"),
    ),
    **json_body("The same parameters as a JSON object, instead of the query"),
}


@router.post("/workflows", openapi_extra=_REGISTRATION)
async def register(request: Request) -> Response:
    try:
        state, params, url = await registration(request)
        settings = state.settings
        store = settings.workflow_store or settings.model_store
        archive = await find_workflow(url, store, settings.allowed_model_urls)
        name = params.get("workflow_name")
        workflow = await asyncio.to_thread(parse_workflow, archive, url, name)
        key = state.keys.torchserve_workflows
        claim = await _claim(state, workflow)
        try:
            elsewhere = await _other_workflows_models(state, workflow.name)
            await _register_nodes(state, workflow, archive, params, elsewhere)
        except Exception as exc:
            if not isinstance(exc, NodesLeft):
                await state.redis.eval(_FORGET, 1, key, workflow.name, claim)
            raise
        # (Cancelled, as when its process stops, the registration leaves its claim: a load
        # already handed to `sluice up` goes on, and the registration that takes the lapsed
        # claim over unregisters what it finds of the models the claim names.)
        await state.redis.hset(key, workflow.name, workflow.to_json())
        message = f"Workflow {workflow.name} has been registered and scaled successfully."
        return json_response({"status": message})
    except SluiceError as exc:
        return error_response(exc)


async def _other_workflows_models(state: GatewayState, name: str) -> dict[str, str]:
    """The models the nodes of every workflow but ``name`` are served as (or are being
    registered as: a claim names them), by workflow. Read after ``name`` is claimed, so that
    of two registrations at once whose nodes make the same model (workflow ``a``'s node
    ``b__c``, workflow ``a__b``'s node ``c``) at least one sees the other's claim."""
    held: dict[str, str] = {}
    entries = await state.redis.hgetall(state.keys.torchserve_workflows)
    for raw_name, raw in entries.items():
        other = _text(raw_name)
        if other == name:
            continue
        if _is_claim(raw):
            models = _claimed_models(raw)
        else:
            models = [node.model for node in Workflow.from_json(raw).nodes.values()]
        held.update(dict.fromkeys(models, other))
    return held


async def _register_nodes(
    state: GatewayState,
    workflow: Workflow,
    archive: WorkflowArchive,
    params: dict[str, str],
    elsewhere: dict[str, str],
) -> None:
    """Register every node at once; when any fails, unregister the others (TorchServe's
    500 naming each failure). ``elsewhere``: the models of other workflows' nodes, by
    workflow."""
    nodes = list(workflow.nodes.values())
    results = await asyncio.gather(
        *(_register_node(state, node, archive, params, elsewhere) for node in nodes),
        return_exceptions=True,
    )
    failures = [
        f"Workflow Node {node.model} failed to register. Details: {_reason(result)}"
        for node, result in zip(nodes, results, strict=True)
        if isinstance(result, BaseException)
    ]
    if failures:
        # A node refused for its model being another's leaves that model be; any other may
        # be served (a load that outlasted the wait for it goes on in `sluice up`), and
        # unregistering one that is not costs nothing.
        ours = [
            node.model
            for node, result in zip(nodes, results, strict=True)
            if not isinstance(result, Conflict)
        ]
        left = await _unregister_nodes(state, ours)
        message = (
            f"Workflow {workflow.name} has failed to register. Failures: [{', '.join(failures)}]"
        )
        if left:
            raise NodesLeft(f"{message}; {', '.join(left)}")
        raise InferenceFailed(message)


class NodesLeft(InferenceFailed):
    """A registration failed, and some of its node models could not be unregistered: its
    claim stays, naming them, for the registration that takes it over once it lapses."""


def _reason(error: BaseException) -> str:
    return error.message if isinstance(error, SluiceError) else type(error).__name__


async def _register_node(
    state: GatewayState,
    node: WorkflowNode,
    archive: WorkflowArchive,
    params: dict[str, str],
    elsewhere: dict[str, str],
) -> None:
    settings = state.settings
    _check_not_served(state, node, elsewhere)
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


def _check_not_served(state: GatewayState, node: WorkflowNode, elsewhere: dict[str, str]) -> None:
    """A node's model is its workflow's own: one served already (registered by a client,
    or by another workflow whose name and node make the same ``<workflow>__<node>``) would
    get the node's archive as a version of its own, and go when the workflow goes. So would
    another workflow's node model that is not served (unregistered by hand, or still being
    registered): each workflow would run, and unregister, the other's."""
    if _served(state, node.model):
        raise Conflict(f"Model {node.model} is already registered.")
    other = elsewhere.get(node.model)
    if other is not None:
        raise Conflict(f"Model {node.model} is already registered, as workflow {other}'s node.")


def _served(state: GatewayState, model: str) -> bool:
    entry = state.view.models.get(model)
    return bool(entry is not None and entry.error != UNLOADED and entry.versions and entry.config)


def _function_model(archive: WorkflowArchive, node: WorkflowNode, url: str) -> Archive:
    """The model archive serving function ``node``, made and read (work on a thread)."""
    return archive_of(function_archive(archive, node), url)


async def _unregister_nodes(state: GatewayState, models: Iterable[str]) -> list[str]:
    """Unregister each of a workflow's node ``models``, all at once (as they are
    registered: within the time of a claim); the failures, named."""
    models = list(models)
    results = await asyncio.gather(
        *(unload(state, model) for model in models), return_exceptions=True
    )
    failures = []
    for model, result in zip(models, results, strict=True):
        if isinstance(result, SluiceError):
            log.warning("unregistering workflow node %s failed: %s", model, result.message)
            failures.append(f"Error while unregistering workflow node {model}")
        elif isinstance(result, BaseException):
            raise result
    return failures


@router.get("/workflows", openapi_extra=PAGES)
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
        key = state.keys.torchserve_workflows
        raw = await state.redis.hget(key, name)
        if raw is None or _is_claim(raw):
            raise WorkflowNotFound(f"Workflow not found: {name}")
        workflow = Workflow.from_json(raw)
        # The workflow becomes a claim naming its models until they are all unregistered:
        # it runs no more, its name is not registered again meanwhile, and should this
        # process stop halfway the models left are still named (for the registration that
        # takes the lapsed claim over).
        claim = _claim_of(state, workflow)
        if not await state.redis.eval(_TAKE_OVER, 1, key, name, raw, claim):
            raise WorkflowNotFound(f"Workflow not found: {name}")  # (another unregistered it)
        failures = await _unregister_nodes(state, (n.model for n in workflow.nodes.values()))
        if failures:
            # Still registered (some of its nodes gone): it may be unregistered again.
            await state.redis.eval(_TAKE_OVER, 1, key, name, claim, raw)
            raise InferenceFailed(
                f"Error while unregistering the workflow {name}. Details: {failures}"
            )
        await state.redis.eval(_FORGET, 1, key, name, claim)
        return json_response({"status": f'Workflow "{name}" unregistered'})
    except SluiceError as exc:
        return error_response(exc)
