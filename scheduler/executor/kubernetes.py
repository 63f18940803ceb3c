"""The executor on Kubernetes: the controller's wanted counts become Deployment replicas.

On one machine ``sluice up`` carries out the controller's decisions by starting and retiring
worker processes (:mod:`.instances`). On Kubernetes every worker pod is one instance
of one model version, so the same decision is a replica count: with
``SLUICE_EXECUTOR=kubernetes`` the controller (``sluice controller``) runs this executor beside
itself. It

- publishes the repository's models to the Redis catalog (what ``sluice up`` does on one
  machine; gateways read it), and again whenever Redis lost it;
- every second reads ``Keys.desired_instances`` and, for each worker Deployment selected by
  ``kubernetes_selector`` whose annotations name a model version with a wanted count, patches
  the Deployment's ``scale`` subresource when its replicas differ. A Deployment whose model
  version has no count keeps the replicas it has (as a local version keeps its configured
  workers);
- every second follows the rollouts of the worker Deployments selected by
  ``kubernetes_rollout_selector`` (however they are scaled): once one has replaced every pod
  of an older pod template (new weights in a new image, a new repository snapshot on a
  restart), it moves the catalog's revision, as a load does on one machine, so that the
  response cache, keyed by the revision, never answers with the old pods' answers after.

Deployments scaled by KEDA instead carry another ``sluice.dev/scaler`` label and are not
selected. Every controller replica runs an executor, leader or not: a patch to the count the
leader decided is idempotent, and a standby keeps the catalog up while the leader changes.

The ``kubernetes`` package is imported only here, and only when this executor is chosen
(``pip install 'sluice[kubernetes]'``).
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, cast

from redis import Redis
from redis.exceptions import RedisError

from sluice.core.errors import InvalidConfig, StartupFailed
from sluice.core.keys import Keys
from sluice.core.repository import scan_repository
from sluice.core.settings import DEFAULT_MAX_BATCH_SIZE, ControllerSettings
from sluice.scheduler.executor.catalog_publisher import publish_catalog, publish_revision

log = logging.getLogger("sluice.scheduler.kubernetes")

MODEL_ANNOTATION = "sluice.dev/model"
"""The model a worker Deployment serves (annotation: exact name; the label of the same name
holds a label-safe form for selectors)."""
VERSION_ANNOTATION = "sluice.dev/version"
"""The version a worker Deployment serves."""
ROLLOUT_ANNOTATION = "deployment.kubernetes.io/revision"
"""The Deployment controller's number of a Deployment's current pod template: a new one for
every rollout (an image, the environment, a restart), none for a change of replicas."""
SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
REQUEST_TIMEOUT_S = 10.0
"""Connect and read timeout of each API call: a hung API server must not stop the executor."""


class ExecutorUnavailable(StartupFailed):
    """The Kubernetes executor cannot start: the package or the cluster configuration is
    missing. ``sluice controller`` reports it as it reports an unreadable repository: one
    line, exit status 2."""


class AppsApi(Protocol):
    """What the executor uses of ``kubernetes.client.AppsV1Api``."""

    def list_namespaced_deployment(self, namespace: str, **kwargs: Any) -> Any: ...

    def patch_namespaced_deployment_scale(
        self, name: str, namespace: str, body: Any, **kwargs: Any
    ) -> Any: ...


def apps_api(settings: ControllerSettings) -> AppsApi:
    """An ``AppsV1Api`` configured from inside the cluster (the pod's service account) or,
    outside one, from the kubeconfig (``KUBECONFIG`` or ``~/.kube/config``)."""
    try:
        from kubernetes import client, config
    except ImportError as exc:
        raise ExecutorUnavailable(
            "SLUICE_EXECUTOR=kubernetes needs the Kubernetes client: "
            "pip install 'sluice[kubernetes]'"
        ) from exc
    # A configuration of its own rather than the client's process-wide default.
    configuration = client.Configuration()
    try:
        config.load_incluster_config(  # type: ignore[no-untyped-call]  # (no annotations)
            client_configuration=configuration
        )
    except config.ConfigException as in_cluster:
        try:
            # KUBECONFIG read now: the client reads it once, when it is first imported.
            config.load_kube_config(  # type: ignore[no-untyped-call]
                config_file=os.environ.get("KUBECONFIG") or None,
                context=settings.kubernetes_context or None,
                client_configuration=configuration,
            )
        except (config.ConfigException, OSError) as exc:
            raise ExecutorUnavailable(
                "SLUICE_EXECUTOR=kubernetes found no cluster configuration: not in a pod "
                f"({in_cluster}) and no usable kubeconfig "
                f"({os.environ.get('KUBECONFIG') or '~/.kube/config'}: {exc})"
            ) from exc
    return cast(AppsApi, client.AppsV1Api(client.ApiClient(configuration)))


def kubernetes_namespace(settings: ControllerSettings) -> str:
    """The namespace of the worker Deployments: the setting, else the pod's own, else
    ``default``."""
    if settings.kubernetes_namespace:
        return settings.kubernetes_namespace
    try:
        return SERVICE_ACCOUNT_NAMESPACE.read_text().strip() or "default"
    except OSError:
        return "default"


def served_field(deployment: Any) -> str | None:
    """The ``Keys.desired_instances`` field ("model:version") a worker Deployment serves, from
    its annotations; None when they are missing or the version is not a number."""
    annotations = deployment.metadata.annotations or {}
    model = annotations.get(MODEL_ANNOTATION)
    version = str(annotations.get(VERSION_ANNOTATION, ""))
    if not model or not version.isdigit():
        return None
    return f"{model}:{int(version)}"


def rolled_out(deployment: Any) -> bool:
    """Whether every pod of ``deployment`` runs its current pod template, as ``kubectl
    rollout status`` tells: the Deployment controller has seen the current spec, every
    replica wanted is of that template, and no pod of an older one is left (pods being
    terminated no longer count: they answer what they hold, taken before, then exit)."""
    status = deployment.status
    if status is None:
        return False
    wanted = deployment.spec.replicas if deployment.spec.replicas is not None else 1
    updated = status.updated_replicas or 0
    return (
        (status.observed_generation or 0) >= (deployment.metadata.generation or 0)
        and updated >= wanted
        and (status.replicas or 0) <= updated
    )


@dataclass
class KubernetesExecutor:
    """Publishes the catalog and keeps the worker Deployments' replicas at the wanted
    counts; :meth:`tick` does one round."""

    client: Redis
    keys: Keys
    apps: AppsApi
    namespace: str
    selector: str
    repository: Path | None = None
    interval_s: float = 1.0
    config_name: str = ""
    """The deployment's custom configuration name
    (:func:`~sluice.core.repository.config_source`)."""
    default_max_batch_size: int = DEFAULT_MAX_BATCH_SIZE
    """What autocomplete gives a model that can batch (SLUICE_DEFAULT_MAX_BATCH_SIZE)."""
    rollout_selector: str = ""
    """Label selector of the worker Deployments whose rollouts move the catalog's revision
    (:meth:`follow_rollouts`); empty: none followed."""
    _published: bool = False
    _unlabelled: set[str] = field(default_factory=set)
    _served: dict[str, str] = field(default_factory=dict)
    """Deployment name -> the pod template (:data:`ROLLOUT_ANNOTATION`) its pods were all
    last seen to run; empty when first seen in the middle of a rollout."""
    _rollouts_listed: bool = True

    def tick(self) -> dict[str, int]:
        """One round; returns the replica counts patched (Deployment name -> replicas). Redis
        errors propagate; an API error is logged and the round goes on."""
        self.keep_catalog()
        self.follow_rollouts()
        raw = cast(dict[bytes, bytes], self.client.hgetall(self.keys.desired_instances))
        wanted = {k.decode(): int(v) for k, v in raw.items() if v.isdigit()}
        if not wanted:
            return {}
        try:
            listing = self.apps.list_namespaced_deployment(
                self.namespace, label_selector=self.selector, _request_timeout=REQUEST_TIMEOUT_S
            )
        except Exception as exc:  # the client's ApiException, or a connection error
            log.warning("cannot list the worker Deployments in '%s': %s", self.namespace, exc)
            return {}
        patched: dict[str, int] = {}
        for deployment in listing.items:
            name = deployment.metadata.name
            served = served_field(deployment)
            if served is None:
                if name not in self._unlabelled:
                    self._unlabelled.add(name)
                    log.warning(
                        "Deployment '%s' has no %s / %s annotations: not scaled",
                        name,
                        MODEL_ANNOTATION,
                        VERSION_ANNOTATION,
                    )
                continue
            count = wanted.get(served)
            current = deployment.spec.replicas
            if count is None or current == count:
                continue
            try:
                self.apps.patch_namespaced_deployment_scale(
                    name,
                    self.namespace,
                    {"spec": {"replicas": count}},
                    _request_timeout=REQUEST_TIMEOUT_S,
                )
            except Exception as exc:
                log.warning("cannot scale Deployment '%s' to %d: %s", name, count, exc)
                continue
            patched[name] = count
            log.info("'%s': Deployment %s scaled %s -> %d", served, name, current, count)
        return patched

    def follow_rollouts(self) -> list[str]:
        """Move the catalog's revision once a followed Deployment's rollout is done (every
        pod of its new template, none of an older one); returns the Deployments whose
        rollout ended this round. Not at the rollout's start: until it ends, pods of the
        old template answer too, and what they answer is kept under the revision in force.
        A Deployment first seen in the middle of a rollout (the controller restarted during
        one) counts as rolled out anew when it ends. Redis errors propagate, and the
        rollouts ended are seen again at the next round."""
        if not self.rollout_selector:
            return []
        try:
            listing = self.apps.list_namespaced_deployment(
                self.namespace,
                label_selector=self.rollout_selector,
                _request_timeout=REQUEST_TIMEOUT_S,
            )
        except Exception as exc:  # the client's ApiException, or a connection error
            if self._rollouts_listed:
                log.warning("cannot follow the worker Deployments' rollouts: %s", exc)
            self._rollouts_listed = False
            return []
        self._rollouts_listed = True
        served: dict[str, str] = {}
        ended: list[str] = []
        for deployment in listing.items:
            name = deployment.metadata.name
            known = self._served.get(name)
            if not rolled_out(deployment):
                served[name] = known if known is not None else ""
                continue
            template = (deployment.metadata.annotations or {}).get(ROLLOUT_ANNOTATION, "")
            served[name] = template
            if known is not None and known != template:
                ended.append(name)
        if ended and publish_revision(self.client, self.keys):
            log.info(
                "rolled out: %s; the catalog's revision moves (the response cache starts afresh)",
                ", ".join(f"Deployment {name}" for name in ended),
            )
        self._served = served
        return ended

    def keep_catalog(self) -> None:
        """Publish the repository's models (model control mode ``none``) at start, and again
        when Redis lost them."""
        if self.repository is None:
            return
        if self._published and self.client.exists(self.keys.catalog_revision):
            return
        if self._published:
            log.warning("the model catalog is gone from Redis (restarted?); publishing it again")
        models = scan_repository(
            self.repository,
            self.config_name,
            default_max_batch_size=self.default_max_batch_size,
        )
        self.client.set(self.keys.control_mode, "none")
        publish_catalog(self.client, self.keys, models)
        self._published = True
        log.info("published %d model(s) of %s to the catalog", len(models), self.repository)

    def run(self, stop_event: threading.Event) -> None:
        """Tick every ``interval_s`` until ``stop_event`` is set."""
        while not stop_event.is_set():
            try:
                self.tick()
            except RedisError as exc:
                log.warning("Redis: %s", exc)
            except InvalidConfig as exc:
                log.error("cannot publish the catalog: %s", exc.message)
            except Exception:
                log.exception("the Kubernetes executor failed; going on")
            stop_event.wait(self.interval_s)


def start_executor(
    settings: ControllerSettings, repository: Path | None, stop_event: threading.Event
) -> threading.Thread | None:
    """The executor chosen by ``SLUICE_EXECUTOR``, started as a thread that ends with
    ``stop_event``; None for ``local`` (``sluice up`` executes). Raises
    :class:`ExecutorUnavailable` when Kubernetes cannot be reached from here."""
    if settings.executor != "kubernetes":
        return None
    executor = KubernetesExecutor(
        Redis.from_url(settings.redis_url, socket_timeout=5, socket_connect_timeout=5),
        Keys(settings.namespace),
        apps_api(settings),
        kubernetes_namespace(settings),
        settings.kubernetes_selector,
        repository,
        config_name=settings.model_config_name,
        default_max_batch_size=settings.default_max_batch_size,
        rollout_selector=settings.kubernetes_rollout_selector,
    )
    log.info(
        "Kubernetes executor: scaling Deployments in '%s' selected by '%s'",
        executor.namespace,
        executor.selector,
    )

    def run() -> None:
        try:
            executor.run(stop_event)
        finally:
            executor.client.close()

    thread = threading.Thread(target=run, name="kubernetes-executor", daemon=True)
    thread.start()
    return thread
