"""The controller's Kubernetes executor against a real Redis and the recorded API contract.

The official ``kubernetes`` client is configured from a kubeconfig that points at
:class:`tests.support.kube_api.KubeApi`, a small HTTP server answering the Deployment list
and ``scale`` calls as the Kubernetes API does (no API server can be installed here: see that
module). What the client sent is checked request by request. The Deployments' rollouts are
followed too: one that ends moves the catalog's revision (the response cache's key).
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from redis import Redis

from sluice.core.catalog import decode_entry
from sluice.core.keys import Keys
from sluice.core.settings import ControllerSettings
from sluice.scheduler.controller.service import run as run_controller
from sluice.scheduler.executor.kubernetes import (
    MODEL_ANNOTATION,
    VERSION_ANNOTATION,
    KubernetesExecutor,
    apps_api,
    kubernetes_namespace,
    start_executor,
)
from sluice.scheduler.executor.redis_server import RedisServer
from tests.support.kube_api import Deployment, KubeApi
from tests.support.procs import wait_until
from tests.support.slow_model import write_slow

NS = "ml"
SELECTOR = "app.kubernetes.io/component=worker,sluice.dev/scaler=controller"
WORKERS = "app.kubernetes.io/component=worker"
"""Every worker Deployment, however scaled: whose rollouts the executor follows."""
POLICY = """
parameters { key: "sluice.min_instances" value { string_value: "1" } }
parameters { key: "sluice.max_instances" value { string_value: "4" } }
parameters { key: "sluice.latency_objective_ms" value { string_value: "200" } }
"""


def worker(
    name: str, model: str, version: int, replicas: int, scaler: str = "controller"
) -> Deployment:
    return Deployment(
        name,
        NS,
        replicas,
        labels={"app.kubernetes.io/component": "worker", "sluice.dev/scaler": scaler},
        annotations={MODEL_ANNOTATION: model, VERSION_ANNOTATION: str(version)},
    )


@pytest.fixture
def kube_api(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[KubeApi]:
    """The contract server, and a kubeconfig naming it (no in-cluster configuration)."""
    api = KubeApi().start()
    config = tmp_path / "kubeconfig"
    config.write_text(yaml.safe_dump(api.kubeconfig()))
    monkeypatch.setenv("KUBECONFIG", str(config))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    yield api
    api.stop()


@pytest.fixture
def redis_client(redis_server: RedisServer) -> Iterator[Redis]:
    client = Redis.from_url(redis_server.url)
    yield client
    client.close()


def settings(redis_server: RedisServer, **values: object) -> ControllerSettings:
    fields: dict[str, object] = {
        "redis_url": redis_server.url,
        "namespace": f"k8s-{uuid.uuid4().hex[:8]}",
        "executor": "kubernetes",
        "kubernetes_namespace": NS,
        "kubernetes_selector": SELECTOR,
    }
    return ControllerSettings(**{**fields, **values})  # type: ignore[arg-type]


def test_deployments_follow_the_wanted_counts(
    kube_api: KubeApi, redis_server: RedisServer, redis_client: Redis
) -> None:
    iris = kube_api.add(worker("sluice-worker-iris-1", "iris", 1, 1))
    mlp = kube_api.add(worker("sluice-worker-mlp-1", "mlp", 1, 2))
    by_keda = kube_api.add(worker("sluice-worker-cnn-1", "cnn", 1, 1, scaler="keda"))
    config = settings(redis_server)
    keys = Keys(config.namespace)
    executor = KubernetesExecutor(redis_client, keys, apps_api(config), NS, SELECTOR)
    redis_client.hset(
        keys.desired_instances, mapping={"iris:1": 3, "mlp:1": 2, "cnn:1": 4, "gone:1": 5}
    )

    assert executor.tick() == {"sluice-worker-iris-1": 3}
    assert (iris.replicas, mlp.replicas, by_keda.replicas) == (3, 2, 1)
    (listing,) = kube_api.calls("GET")
    assert listing.path == f"/apis/apps/v1/namespaces/{NS}/deployments"
    assert listing.query == {"labelSelector": [SELECTOR]}
    assert listing.headers["authorization"] == "Bearer test-token"
    (patch,) = kube_api.calls("PATCH")
    assert patch.path == f"/apis/apps/v1/namespaces/{NS}/deployments/sluice-worker-iris-1/scale"
    assert patch.headers["content-type"] == "application/strategic-merge-patch+json"
    assert patch.body == {"spec": {"replicas": 3}}

    # Nothing changed: listed again, patched nothing.
    assert executor.tick() == {}
    assert len(kube_api.calls("PATCH")) == 1

    # To zero (a model whose minimum is 0 and that stayed idle) and back.
    redis_client.hset(keys.desired_instances, "iris:1", 0)
    assert executor.tick() == {"sluice-worker-iris-1": 0}
    redis_client.hset(keys.desired_instances, "iris:1", 1)
    assert executor.tick() == {"sluice-worker-iris-1": 1}
    assert iris.replicas == 1


def test_no_wanted_count_and_unannotated_deployments_are_left_alone(
    kube_api: KubeApi, redis_server: RedisServer, redis_client: Redis
) -> None:
    bare = kube_api.add(worker("hand-made", "x", 1, 2))
    bare.annotations = {}
    kube_api.add(worker("sluice-worker-iris-1", "iris", 1, 1))
    config = settings(redis_server)
    keys = Keys(config.namespace)
    executor = KubernetesExecutor(redis_client, keys, apps_api(config), NS, SELECTOR)

    assert executor.tick() == {}
    assert kube_api.calls("GET") == []  # no wanted count at all: no call

    redis_client.hset(keys.desired_instances, "x:1", 5)
    assert executor.tick() == {}
    assert bare.replicas == 2
    assert kube_api.calls("PATCH") == []


def test_an_unreachable_api_server_is_logged_and_the_executor_goes_on(
    kube_api: KubeApi,
    redis_server: RedisServer,
    redis_client: Redis,
    caplog: pytest.LogCaptureFixture,
) -> None:
    config = settings(redis_server)
    keys = Keys(config.namespace)
    apps = apps_api(config)
    kube_api.stop()
    redis_client.hset(keys.desired_instances, "iris:1", 2)
    executor = KubernetesExecutor(redis_client, keys, apps, NS, SELECTOR)
    assert executor.tick() == {}
    assert "cannot list the worker Deployments" in caplog.text


def test_namespace_defaults_to_the_pods_own(
    redis_server: RedisServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import sluice.scheduler.executor.kubernetes as module

    config = settings(redis_server, kubernetes_namespace="")
    monkeypatch.setattr(module, "SERVICE_ACCOUNT_NAMESPACE", tmp_path / "missing")
    assert kubernetes_namespace(config) == "default"
    (tmp_path / "namespace").write_text("inference\n")
    monkeypatch.setattr(module, "SERVICE_ACCOUNT_NAMESPACE", tmp_path / "namespace")
    assert kubernetes_namespace(config) == "inference"


@pytest.mark.timeout(60)
def test_the_controller_publishes_the_catalog_and_its_autoscaler_scales_the_deployment(
    kube_api: KubeApi, redis_server: RedisServer, redis_client: Redis, tmp_path: Path
) -> None:
    """``sluice controller`` with SLUICE_EXECUTOR=kubernetes, end to end: the catalog the
    gateways need appears, and a request waiting too long makes the autoscaler want more
    instances, which the executor turns into a patch of the worker Deployment's scale."""
    write_slow(tmp_path, "slow", max_batch_size=1, extra=POLICY)
    deployment = kube_api.add(worker("sluice-worker-slow-1", "slow", 1, 1))
    config = settings(redis_server, model_repository=str(tmp_path))
    keys = Keys(config.namespace)
    stop = threading.Event()
    thread = threading.Thread(
        target=run_controller,
        args=(config, stop),
        kwargs={"announce": False, "start_executor": start_executor},
    )
    thread.start()
    try:
        assert wait_until(lambda: redis_client.hexists(keys.catalog, "slow"), 10)
        entry = decode_entry(redis_client.hget(keys.catalog, "slow"))  # type: ignore[arg-type]
        assert entry.versions == (1,)
        assert redis_client.get(keys.control_mode) == b"none"
        # A request enqueued long ago and not taken: the oldest is far past the objective.
        redis_client.xadd(keys.request_stream("slow", 1), {"id": "r1"}, id="1-1")
        # It stays that old, so the instances double (1, 2, 4) up to the maximum, 4.
        assert wait_until(lambda: deployment.replicas == 4, 15), kube_api.requests
        assert redis_client.hget(keys.desired_instances, "slow:1") == b"4"
        patches = kube_api.calls("PATCH")
        assert {p.path for p in patches} == {
            f"/apis/apps/v1/namespaces/{NS}/deployments/sluice-worker-slow-1/scale"
        }
        # Each decision doubles (2, then 4); the executor patches what it reads each second,
        # so on a busy machine it may read the 4 first and never patch the 2.
        replicas = [p.body["spec"]["replicas"] for p in patches]
        assert replicas in ([2, 4], [4]), replicas
        # The worker Deployment rolls new weights out: once done, the revision moves.
        before = revision(redis_client, keys)
        assert before is not None
        deployment.roll_out("sluice:v2")
        deployment.finish()
        assert wait_until(lambda: revision(redis_client, keys) == before + 1, 10)
        # Redis lost the catalog (a restart without persistence): published again.
        redis_client.delete(keys.catalog, keys.catalog_revision)
        assert wait_until(lambda: redis_client.hexists(keys.catalog, "slow"), 10)
    finally:
        stop.set()
        thread.join(15)
    assert not thread.is_alive()


def revision(client: Redis, keys: Keys) -> int | None:
    raw = client.get(keys.catalog_revision)
    return None if raw is None else int(raw)


def test_a_rollout_moves_the_catalog_revision_once_every_pod_is_new(
    kube_api: KubeApi, redis_server: RedisServer, redis_client: Redis, tmp_path: Path
) -> None:
    """New weights reach a model by a rollout of its worker Deployment (a new image, a
    restart that copies a newer repository): the response cache, keyed by the catalog's
    revision, must not answer with the old pods' answers after it. The revision moves once,
    when no pod of the old template is left, for a Deployment however scaled (KEDA's too),
    and not for a change of replicas."""
    write_slow(tmp_path, "slow", max_batch_size=1)
    scaled = kube_api.add(worker("sluice-worker-slow-1", "slow", 1, 2))
    by_keda = kube_api.add(worker("sluice-worker-cnn-1", "cnn", 1, 2, scaler="keda"))
    config = settings(redis_server)
    keys = Keys(config.namespace)
    executor = KubernetesExecutor(
        redis_client,
        keys,
        apps_api(config),
        NS,
        SELECTOR,
        tmp_path,
        rollout_selector=WORKERS,
    )
    executor.tick()
    published = revision(redis_client, keys)
    assert published is not None
    listing = next(c for c in kube_api.calls("GET") if c.query["labelSelector"] == [WORKERS])
    assert listing.path == f"/apis/apps/v1/namespaces/{NS}/deployments"

    by_keda.roll_out("sluice:v2")
    assert executor.follow_rollouts() == []  # not yet seen by the Deployment controller
    by_keda.progress(updated=1, old=2)
    assert executor.follow_rollouts() == []  # old pods still answer
    by_keda.progress(updated=2, old=0)
    assert executor.tick() == {}
    assert revision(redis_client, keys) == published + 1
    assert executor.follow_rollouts() == []  # (once)
    assert revision(redis_client, keys) == published + 1

    # The controller scales: no new template, no new revision.
    redis_client.hset(keys.desired_instances, "slow:1", 3)
    assert executor.tick() == {"sluice-worker-slow-1": 3}
    assert executor.tick() == {}
    assert revision(redis_client, keys) == published + 1

    # A controller started in the middle of a rollout counts it when it ends.
    scaled.roll_out("sluice:v3")
    scaled.progress(updated=1, old=2)
    restarted = KubernetesExecutor(
        redis_client, keys, apps_api(config), NS, SELECTOR, rollout_selector=WORKERS
    )
    assert restarted.follow_rollouts() == []
    scaled.finish()
    assert restarted.follow_rollouts() == ["sluice-worker-slow-1"]
    assert revision(redis_client, keys) == published + 2


def test_a_rollout_numbers_no_catalog_that_redis_lost(
    kube_api: KubeApi, redis_server: RedisServer, redis_client: Redis
) -> None:
    """Without a catalog (Redis restarted, or none published yet) a rollout writes no
    revision: its keepers must still find the catalog lost and publish it again."""
    by_keda = kube_api.add(worker("sluice-worker-cnn-1", "cnn", 1, 1, scaler="keda"))
    config = settings(redis_server)
    keys = Keys(config.namespace)
    executor = KubernetesExecutor(
        redis_client, keys, apps_api(config), NS, SELECTOR, rollout_selector=WORKERS
    )
    assert executor.follow_rollouts() == []
    by_keda.roll_out("sluice:v2")
    by_keda.finish()
    assert executor.follow_rollouts() == ["sluice-worker-cnn-1"]
    assert revision(redis_client, keys) is None
