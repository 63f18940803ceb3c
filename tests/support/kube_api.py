"""A recorded contract of the Kubernetes API calls the controller's executor makes.

No Kubernetes API server can be installed here (Debian has etcd but no kube-apiserver; PyPI
and npm ship no envtest-like binary), so the executor's tests talk over real HTTP to this small
server instead. It answers the three calls the official ``kubernetes`` client makes for the
executor, with bodies shaped as the Kubernetes API reference (apps/v1 Deployment and
DeploymentList, autoscaling/v1 Scale, meta/v1 Status) gives them, and records every request it
gets (method, path, query, headers, body) for the tests to check:

- ``GET /apis/apps/v1/namespaces/{ns}/deployments?labelSelector=...`` (equality-based
  selectors: ``k=v``, ``k==v``, ``k!=v``, ``k``, ``!k``, comma-separated);
- ``GET /apis/apps/v1/namespaces/{ns}/deployments/{name}/scale``;
- ``PATCH`` of the same path with a JSON merge patch or a strategic merge patch of
  ``spec.replicas`` (as ``kubectl scale`` and the HorizontalPodAutoscaler set replicas).

A Deployment's rollout (:meth:`Deployment.roll_out`, ``progress``, ``finish``) shows as the
Deployment controller shows it: a new generation the status has not observed yet, then the
pods of the new template (``updatedReplicas``) beside those of the older one (counted in
``replicas``), the controller's ``deployment.kubernetes.io/revision`` annotation numbering
the template.

Anything else is answered 404 with a ``Status``, as the real server answers an unknown path.
"""

from __future__ import annotations

import json
import re
import threading
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

PATCH_TYPES = ("application/merge-patch+json", "application/strategic-merge-patch+json")
_LIST = re.compile(r"^/apis/apps/v1/namespaces/([^/]+)/deployments$")
_SCALE = re.compile(r"^/apis/apps/v1/namespaces/([^/]+)/deployments/([^/]+)/scale$")
CREATED = "2026-01-01T00:00:00Z"
ROLLOUT_REVISION = "deployment.kubernetes.io/revision"


@dataclass
class Deployment:
    name: str
    namespace: str
    replicas: int
    labels: dict[str, str] = field(default_factory=dict)
    annotations: dict[str, str] = field(default_factory=dict)
    uid: str = field(default_factory=lambda: str(uuid.uuid4()))
    generation: int = 1
    image: str = "sluice:test"
    template: int = 1
    """The Deployment controller's number of the current pod template (its
    ``deployment.kubernetes.io/revision`` annotation): one more on every rollout."""
    observed: int | None = None
    """``status.observedGeneration``; None: the current generation (the spec was seen)."""
    updated: int | None = None
    """Pods of the current template (``status.updatedReplicas``); None: every replica."""
    old: int = 0
    """Pods of an older template still running (counted in ``status.replicas``)."""

    def roll_out(self, image: str) -> None:
        """A new pod template (``kubectl set image``, a ``helm upgrade``), not yet seen by
        the Deployment controller: every pod is of the older one."""
        self.image = image
        self.generation += 1
        self.observed = self.generation - 1
        self.old, self.updated = self.replicas, 0

    def progress(self, updated: int, old: int) -> None:
        """The controller has seen the new template; ``updated`` pods run it, ``old`` pods
        the older one."""
        if self.observed is not None:  # (seen now: the template gets its revision)
            self.template += 1
            self.observed = None
        self.updated, self.old = updated, old

    def finish(self) -> None:
        """The rollout is done: every replica of the current template, none older."""
        if self.observed is not None:
            self.progress(self.replicas, 0)
        self.updated, self.old = None, 0

    def metadata(self, version: int) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "name": self.name,
            "namespace": self.namespace,
            "uid": self.uid,
            "resourceVersion": str(version),
            "generation": self.generation,
            "creationTimestamp": CREATED,
            "labels": dict(self.labels),
        }
        # (the Deployment controller writes its revision beside the owner's annotations)
        meta["annotations"] = {**self.annotations, ROLLOUT_REVISION: str(self.template)}
        return meta

    def body(self, version: int) -> dict[str, Any]:
        """The Deployment as an item of a DeploymentList (items carry no kind/apiVersion)."""
        pod_labels = {"app.kubernetes.io/name": self.name}
        updated = self.replicas if self.updated is None else self.updated
        return {
            "metadata": self.metadata(version),
            "spec": {
                "replicas": self.replicas,
                "selector": {"matchLabels": pod_labels},
                "template": {
                    "metadata": {"labels": pod_labels},
                    "spec": {"containers": [{"name": "worker", "image": self.image}]},
                },
                "strategy": {
                    "type": "RollingUpdate",
                    "rollingUpdate": {"maxUnavailable": "25%", "maxSurge": "25%"},
                },
                "revisionHistoryLimit": 10,
                "progressDeadlineSeconds": 600,
            },
            "status": {
                "observedGeneration": self.generation if self.observed is None else self.observed,
                "replicas": updated + self.old,
                "updatedReplicas": updated,
                "readyReplicas": updated + self.old,
                "availableReplicas": updated + self.old,
            },
        }

    def scale(self, version: int) -> dict[str, Any]:
        meta = self.metadata(version)
        meta.pop("labels")
        meta.pop("annotations", None)
        meta.pop("generation")
        return {
            "kind": "Scale",
            "apiVersion": "autoscaling/v1",
            "metadata": meta,
            "spec": {"replicas": self.replicas},
            "status": {
                "replicas": self.replicas,
                "selector": f"app.kubernetes.io/name={self.name}",
            },
        }


@dataclass
class Recorded:
    method: str
    path: str
    query: dict[str, list[str]]
    headers: dict[str, str]
    body: Any


def status(code: int, reason: str, message: str, **details: Any) -> dict[str, Any]:
    """A meta/v1 Status, the body of every error the API server answers."""
    body: dict[str, Any] = {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }
    if details:
        body["details"] = details
    return body


def matches(labels: dict[str, str], selector: str) -> bool:
    """Whether ``labels`` satisfy an equality-based label selector."""
    for term in filter(None, (t.strip() for t in selector.split(","))):
        if "!=" in term:
            key, value = term.split("!=", 1)
            if labels.get(key) == value:
                return False
        elif "=" in term:
            key, value = term.replace("==", "=").split("=", 1)
            if labels.get(key) != value:
                return False
        elif term.startswith("!"):
            if term[1:] in labels:
                return False
        elif term not in labels:
            return False
    return True


class KubeApi:
    """The contract server on a free loopback port; :meth:`stop` always."""

    def __init__(self) -> None:
        self.deployments: dict[tuple[str, str], Deployment] = {}
        self.requests: list[Recorded] = []
        self.resource_version = 1000
        self.lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host!s}:{port}"

    def start(self) -> KubeApi:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)

    def add(self, deployment: Deployment) -> Deployment:
        with self.lock:
            self.deployments[(deployment.namespace, deployment.name)] = deployment
        return deployment

    def calls(self, method: str) -> list[Recorded]:
        with self.lock:
            return [r for r in self.requests if r.method == method]

    def kubeconfig(self, token: str = "test-token") -> dict[str, Any]:
        """A kubeconfig whose current context is this server, with a bearer token."""
        return {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "contract", "cluster": {"server": self.url}}],
            "users": [{"name": "controller", "user": {"token": token}}],
            "contexts": [
                {"name": "contract", "context": {"cluster": "contract", "user": "controller"}}
            ],
            "current-context": "contract",
        }

    def answer(self, recorded: Recorded) -> tuple[int, dict[str, Any]]:
        with self.lock:
            self.requests.append(recorded)
            if match := _LIST.match(recorded.path):
                if recorded.method != "GET":
                    return 405, status(405, "MethodNotAllowed", "the server does not allow this")
                selector = recorded.query.get("labelSelector", [""])[0]
                items = [
                    d.body(self.resource_version)
                    for (ns, _), d in sorted(self.deployments.items())
                    if ns == match[1] and matches(d.labels, selector)
                ]
                return 200, {
                    "kind": "DeploymentList",
                    "apiVersion": "apps/v1",
                    "metadata": {"resourceVersion": str(self.resource_version)},
                    "items": items,
                }
            if match := _SCALE.match(recorded.path):
                namespace, name = match[1], match[2]
                deployment = self.deployments.get((namespace, name))
                if deployment is None:
                    return 404, status(
                        404,
                        "NotFound",
                        f'deployments.apps "{name}" not found',
                        name=name,
                        group="apps",
                        kind="deployments",
                    )
                if recorded.method == "PATCH":
                    content_type = recorded.headers.get("content-type", "").split(";")[0]
                    if content_type not in PATCH_TYPES:
                        return 415, status(
                            415,
                            "UnsupportedMediaType",
                            f"the body of the request was in an unknown format - accepted "
                            f"media types include: {', '.join(PATCH_TYPES)}",
                        )
                    replicas = (recorded.body or {}).get("spec", {}).get("replicas")
                    if not isinstance(replicas, int) or replicas < 0:
                        return 422, status(
                            422,
                            "Invalid",
                            f'Scale.autoscaling "{name}" is invalid: spec.replicas: Invalid '
                            f"value: {replicas!r}: must be greater than or equal to 0",
                        )
                    deployment.replicas = replicas
                    deployment.generation += 1
                    self.resource_version += 1
                elif recorded.method != "GET":
                    return 405, status(405, "MethodNotAllowed", "the server does not allow this")
                return 200, deployment.scale(self.resource_version)
            return 404, status(404, "NotFound", "the server could not find the requested resource")


def _handler(api: KubeApi) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def _serve(self) -> None:
            parts = urlsplit(self.path)
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            recorded = Recorded(
                self.command,
                parts.path,
                parse_qs(parts.query),
                {k.lower(): v for k, v in self.headers.items()},
                json.loads(raw) if raw else None,
            )
            code, body = api.answer(recorded)
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_PATCH = do_POST = do_PUT = do_DELETE = _serve

        def log_message(self, format: str, *args: Any) -> None:
            pass

    return Handler
