"""TorchServe workflow archives (``.war``, made by ``torch-workflow-archiver``) and the
workflows they describe.

A .war is a zip holding ``WAR-INF/MANIFEST.json`` (``workflow.workflowName``,
``specFile``, ``handler``), the specification (YAML), the handler file of the workflow's
functions and any extra files. The specification's ``models`` section gives settings for
every model (``min-workers``, ``max-workers``, ``batch-size``, ``max-batch-delay``,
``retry-attempts``, ``timeout-ms``) and, under a name of its own, each model's archive
(``url``) with settings that override them. Its ``dag`` says which node feeds which; a node
is a model of the ``models`` section, or else a function of the handler file.

As in TorchServe, every node is served as a model of its own, named
``<workflow>__<node>`` (a function as a TorchServe handler ``<handler file>:<function>``,
one worker, batches of one), and the graph has exactly one start node and no cycle. A node
with one parent receives its parent's answer as its body; a node with several receives one
part per parent, named after it.
"""

from __future__ import annotations

import io
import json
import time
import zipfile
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from sluice.core.errors import InvalidInput
from sluice.core.torchserve.archives import MANIFEST as MAR_MANIFEST
from sluice.core.torchserve.archives import UnpackLimits, read_small_archive
from sluice.core.torchserve.config import check_model_name

MANIFEST = "WAR-INF/MANIFEST.json"
MAX_WAR_BYTES = 64 << 20
"""A workflow archive holds its specification, its functions and their files (the models
are archives of their own, named by URL): more than this is refused."""
MAX_SPEC_BYTES = 1 << 20
MAX_NODES = 64
SEPARATOR = "__"

SETTINGS = {
    "min-workers": 1,
    "max-workers": 1,
    "batch-size": 1,
    "max-batch-delay": 50,
    "retry-attempts": 1,
    "timeout-ms": 10_000,
}
"""Each setting of the specification's ``models`` section, with TorchServe's default."""
_LARGEST = {"min-workers": 64, "max-workers": 64, "batch-size": 1_000_000, "retry-attempts": 10}
"""(Each try of a node that keeps failing is one more call of its model per request.)"""
_LARGEST_DEFAULT = 86_400_000


def invalid(reason: str) -> InvalidInput:
    """TorchServe's 400 for a specification it cannot serve, with the reason."""
    return InvalidInput(f"Invalid workflow specification: {reason}")


@dataclass(frozen=True, slots=True)
class WorkflowNode:
    """One node of a workflow's graph, and the model it is served as."""

    name: str
    model: str
    """``<workflow>__<node>``."""
    url: str | None
    """The model archive's URL (as ``POST /models?url=`` takes it); None: a function of
    the workflow's handler file."""
    min_workers: int = 1
    max_workers: int = 1
    batch_size: int = 1
    max_batch_delay_ms: int = 0
    retry_attempts: int = 1
    """How many times a failed call is tried again."""
    timeout_ms: int = 10_000
    """How long one call may take."""


@dataclass(frozen=True)
class Workflow:
    """A registered workflow: its nodes, who feeds whom, and what ``GET /workflows/{name}``
    describes."""

    name: str
    url: str
    nodes: dict[str, WorkflowNode]
    children: dict[str, tuple[str, ...]]
    settings: dict[str, int] = field(default_factory=dict)
    """The specification's settings for every model (with TorchServe's defaults)."""
    dag: str = ""
    """The ``dag`` section as TorchServe's description shows it (``{a=[b], b=[c]}``)."""

    def parents(self, node: str) -> tuple[str, ...]:
        return tuple(name for name, kids in self.children.items() if node in kids)

    @property
    def start(self) -> str:
        return next(name for name in self.nodes if not self.parents(name))

    @property
    def leaves(self) -> tuple[str, ...]:
        return tuple(name for name in self.nodes if not self.children.get(name))

    def to_json(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def from_json(cls, data: bytes | str) -> Workflow:
        raw = json.loads(data)
        return cls(
            raw["name"],
            raw["url"],
            {name: WorkflowNode(**node) for name, node in raw["nodes"].items()},
            {name: tuple(kids) for name, kids in raw["children"].items()},
            dict(raw["settings"]),
            raw["dag"],
        )


@dataclass(frozen=True)
class WorkflowArchive:
    """What a .war holds: its workflow's name, its specification and its files."""

    name: str
    spec: str
    handler: str
    """The handler file's name in the archive ("" without one)."""
    files: dict[str, bytes]
    """Every file but the manifest, by its path in the archive."""


def read_war(path: Path) -> WorkflowArchive:
    """The archive at ``path``, checked: at most :data:`MAX_WAR_BYTES` unpacked, every name
    inside it, a manifest naming the workflow, a specification and a handler it holds."""
    limits = UnpackLimits(total_bytes=MAX_WAR_BYTES, entries=1000)
    files = read_small_archive(path, limits)
    raw = files.pop(MANIFEST, None)
    if raw is None:
        raise InvalidInput(f"{MANIFEST} is missing (not made by torch-workflow-archiver?)")
    try:
        manifest = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise InvalidInput(f"{MANIFEST} is not JSON ({exc})") from None
    workflow = manifest.get("workflow") if isinstance(manifest, dict) else None
    if not isinstance(workflow, dict):
        raise InvalidInput("Missing Workflow entry in manifest file.")
    name, spec_file = workflow.get("workflowName"), workflow.get("specFile")
    handler = workflow.get("handler") or ""
    if not isinstance(name, str) or not name:
        raise InvalidInput("Workflow name is not defined.")
    if not isinstance(spec_file, str) or spec_file not in files:
        raise InvalidInput(f"the manifest's specFile {_shown(spec_file)} is not in the archive")
    if not isinstance(handler, str) or (handler and handler not in files):
        raise InvalidInput(f"the manifest's handler {_shown(handler)} is not in the archive")
    spec = files[spec_file]
    if len(spec) > MAX_SPEC_BYTES:
        raise invalid(f"{spec_file} is larger than {MAX_SPEC_BYTES} bytes")
    try:
        text = spec.decode()
    except UnicodeDecodeError:
        raise invalid(f"{spec_file} is not UTF-8 text") from None
    return WorkflowArchive(name, text, handler, files)


def _importable(handler: str) -> bool:
    """Whether TorchServe's handler loader imports ``handler`` itself: it imports the
    module named by the file's name from the archive's root, wherever the file is."""
    return handler.endswith(".py") and handler.removesuffix(".py").isidentifier()


def _shown(value: object) -> str:
    """``value`` as an error names it: a short text or number as it is, anything else (a
    list or mapping an alias may make enormous) by its kind."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**30:
        return "a huge number"
    if value is None or isinstance(value, bool | int | float | str):
        text = repr(value)
        return text if len(text) <= 80 else text[:77] + "..."
    return f"a {type(value).__name__}"


def parse_workflow(archive: WorkflowArchive, url: str, name: str | None = None) -> Workflow:
    """The workflow ``archive`` specifies, registered from ``url`` as ``name`` (else the
    manifest's name)."""
    name = name or archive.name
    check_model_name(name, "workflow")
    spec = _loaded(archive.spec)
    if not isinstance(spec, dict) or not isinstance(spec.get("dag"), dict):
        raise invalid("it needs a 'dag' section mapping each node to the nodes it feeds")
    models = spec.get("models", {})
    if models is None:
        models = {}
    if not isinstance(models, dict):
        raise invalid("'models' must map settings and model names")
    settings = {key: _setting(models, key, default) for key, default in SETTINGS.items()}
    children = _graph(spec["dag"])
    nodes = {
        node: _node(name, node, models.get(node), settings, archive.handler) for node in children
    }
    _check_graph(children)
    dag = "{" + ", ".join(f"{k}=[{', '.join(v)}]" for k, v in children.items()) + "}"
    return Workflow(name, url, nodes, children, settings, dag)


def _loaded(text: str) -> Any:
    """The specification's YAML; a refusal for what is no YAML, nests too deeply or holds a
    value that cannot be made (a number of thousands of digits, a day 2020-13-45)."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise invalid(f"the specification is not YAML ({exc})") from None
    except RecursionError:
        raise invalid("the specification nests too deeply") from None
    except (ValueError, OverflowError) as exc:
        raise invalid(f"the specification holds a value that cannot be read ({exc})") from None


def _setting(section: Mapping[str, Any], key: str, default: int) -> int:
    value = section.get(key, default)
    largest = _LARGEST.get(key, _LARGEST_DEFAULT)
    least = 1 if key in ("batch-size", "max-workers", "timeout-ms") else 0
    if isinstance(value, bool) or not isinstance(value, int) or not least <= value <= largest:
        raise invalid(
            f"'{key}' must be a whole number from {least} to {largest}, not {_shown(value)}"
        )
    return value


def _graph(dag: Mapping[Any, Any]) -> dict[str, tuple[str, ...]]:
    """Node -> the nodes it feeds, every node named (an empty entry is skipped, as in
    TorchServe), in the order the specification names them."""
    children: dict[str, tuple[str, ...]] = {}
    for node, kids in dag.items():
        if not isinstance(node, str) or not node:
            raise invalid(f"a node of 'dag' must be named, not {_shown(node)}")
        if kids is None:
            kids = []
        if not isinstance(kids, list) or not all(k is None or isinstance(k, str) for k in kids):
            raise invalid(f"'dag': '{node}' must map to a list of node names")
        named = [k.strip() for k in kids if k is not None and k.strip()]
        if node in named:
            raise invalid(f"'dag': '{node}' feeds itself")
        children[node] = tuple(dict.fromkeys([*children.get(node, ()), *named]))
        for kid in named:
            children.setdefault(kid, ())
        if len(children) > MAX_NODES:
            raise invalid(f"more than {MAX_NODES} nodes")
    return children


def _node(
    workflow: str, node: str, entry: Any, settings: Mapping[str, int], handler: str
) -> WorkflowNode:
    model = f"{workflow}{SEPARATOR}{node}"
    check_model_name(model, f"node '{node}' of workflow {workflow}")
    if entry is None:
        if not handler:
            raise invalid(
                f"node '{node}' is not a model of 'models', and the archive has no handler "
                "file of functions"
            )
        if not _importable(handler):
            raise invalid(
                f"function '{node}' is in handler file {_shown(handler)}, which TorchServe "
                "cannot import: it must be a Python file at the archive's root (as "
                "torch-workflow-archiver puts it), named as a module"
            )
        if not node.isidentifier():
            raise invalid(f"node '{node}' names no Python function of the handler file")
        return WorkflowNode(
            node,
            model,
            None,
            retry_attempts=settings["retry-attempts"],
            timeout_ms=settings["timeout-ms"],
        )
    if not isinstance(entry, dict) or not isinstance(entry.get("url"), str) or not entry["url"]:
        raise invalid(f"model '{node}' needs a 'url' naming its archive")
    own = {key: _setting(entry, key, settings[key]) for key in SETTINGS}
    return WorkflowNode(
        node,
        model,
        entry["url"],
        own["min-workers"],
        own["max-workers"],
        own["batch-size"],
        own["max-batch-delay"],
        own["retry-attempts"],
        own["timeout-ms"],
    )


def _check_graph(children: Mapping[str, tuple[str, ...]]) -> None:
    """Exactly one start node, and every node reached in an order (no cycle)."""
    waiting = {node: 0 for node in children}
    for kids in children.values():
        for kid in kids:
            waiting[kid] += 1
    ready = [node for node, count in waiting.items() if count == 0]
    if len(ready) != 1:
        raise invalid("DAG should have only one start node")
    reached = 0
    while ready:
        node = ready.pop()
        reached += 1
        for kid in children[node]:
            waiting[kid] -= 1
            if waiting[kid] == 0:
                ready.append(kid)
    if reached != len(children):
        raise invalid("Not a valid DAG (it has a cycle)")


def function_archive(archive: WorkflowArchive, node: WorkflowNode) -> bytes:
    """A model archive (.mar) serving function ``node`` of the workflow's handler file, with
    every file of the workflow archive beside it (as TorchServe runs it)."""
    manifest = {
        "createdOn": time.strftime("%d/%m/%Y %H:%M:%S"),
        "runtime": "python",
        "model": {
            "modelName": node.model,
            "handler": f"{archive.handler}:{node.name}",
            "modelVersion": "1.0",
        },
        "archiverVersion": "sluice",
    }
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as mar:
        mar.writestr(MAR_MANIFEST, json.dumps(manifest))
        for path, data in archive.files.items():
            if not path.startswith("MAR-INF/"):  # (the function's own manifest is above)
                mar.writestr(path, data)
    return buffer.getvalue()
