"""deploy/helm/sluice: rendered and linted by Helm itself, offline, and every manifest checked
against its schema.

Helm comes from the ``helm-python-sdk`` wheel (Helm's Go SDK built as a C library, driven
through ctypes; the dev extra installs it): ``Chart.render`` is what ``helm template`` does and
``lint`` what ``helm lint`` does. Built-in kinds are validated against Kubernetes' own OpenAPI
schemas (``kubernetes-validate``, strict: an unknown field is an error); KEDA's ScaledObject and
the Prometheus Operator's ServiceMonitor against the openAPIV3Schema of their
CustomResourceDefinitions, vendored in tests/data/crds (see tests/data/README.md). Then what
the manifests must mean for Sluice: the streams KEDA reads, the Deployments the controller's
executor scales, probes, PodDisruptionBudgets, GPUs.
"""

from __future__ import annotations

import base64
import copy
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import jsonschema
import pytest
import yaml

from sluice.scheduler.executor.kubernetes import served_field
from tests.support.kube_api import matches

try:
    import helm_python as helm
except ImportError as exc:  # a failure, never a skip: the chart would go untested
    raise ImportError(
        "the Helm chart tests need helm-python-sdk (pip install -e '.[dev]'; its wheels are "
        "for x86-64 Linux, macOS and Windows)"
    ) from exc
import kubernetes_validate

ROOT = Path(__file__).resolve().parents[3]
CHART = ROOT / "deploy" / "helm" / "sluice"
CRDS = ROOT / "tests" / "data" / "crds"
KUBERNETES_VERSIONS = ("1.29.0", "1.32.0")
"""The oldest and a recent Kubernetes the chart is checked against (Chart.yaml: >=1.25)."""

EVERYTHING = {
    "models": [
        {"name": "iris", "version": 1},
        {"name": "My_Model.v2", "version": 3, "scaling": "controller", "gpu": True},
        {"name": "ranked", "version": 2, "keda": {"priorityLevels": 2, "background": False}},
        {
            "name": "fixed",
            "version": 1,
            "scaling": "none",
            "replicas": 3,
            "pdb": {"enabled": False},
        },
    ],
    "redis": {
        "cluster": True,
        "address": "redis-0:6379,redis-1:6379,redis-2:6379",
        "existingSecret": "sluice-redis",
        "kedaAuthenticationRef": "sluice-redis-auth",
    },
    "modelRepository": {
        "url": "s3://models/prod",
        "s3": {"endpointUrl": "http://minio:9000", "credentialsSecret": "models-s3"},
    },
    "monitoring": {"serviceMonitor": {"enabled": True, "labels": {"release": "prometheus"}}},
    "namespace": "prod",
}


def render(values: dict[str, Any], release: str = "demo") -> list[dict[str, Any]]:
    """``helm template`` of the chart with these values: every document, in order."""
    with helm.Chart.load(str(CHART)) as chart:
        files = chart.render(values, name=release, namespace="ml")
    documents: list[dict[str, Any]] = []
    for name in sorted(files):
        if name.endswith(".yaml"):
            documents += [d for d in yaml.safe_load_all(files[name]) if d]
    return documents


def of_kind(documents: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in documents if d["kind"] == kind}


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def crd_schema(file: str) -> dict[str, Any]:
    """A CRD's openAPIV3Schema as a JSON Schema that also refuses unknown fields: the API
    server would prune them silently, which for a chart is a mistake all the same."""
    crd = yaml.safe_load((CRDS / file).read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v.get("storage")]
    schema = copy.deepcopy(version["schema"]["openAPIV3Schema"])

    def close(node: Any) -> None:
        if isinstance(node, dict):
            closable = "properties" in node and "additionalProperties" not in node
            if closable and not node.get("x-kubernetes-preserve-unknown-fields"):
                node["additionalProperties"] = False
            for value in node.values():
                close(value)
        elif isinstance(node, list):
            for value in node:
                close(value)

    close(schema)
    return schema


CRD_SCHEMAS = {
    ("keda.sh/v1alpha1", "ScaledObject"): "keda.sh_scaledobjects.yaml",
    ("monitoring.coreos.com/v1", "ServiceMonitor"): "monitoring.coreos.com_servicemonitors.yaml",
}


def schema_errors(document: dict[str, Any]) -> list[str]:
    key = (document["apiVersion"], document["kind"])
    name = f"{document['kind']} {document['metadata']['name']}"
    if key in CRD_SCHEMAS:
        validator = jsonschema.Draft7Validator(crd_schema(CRD_SCHEMAS[key]))
        errors = [
            f"{name}: {'/'.join(map(str, e.absolute_path))}: {e.message}"
            for e in validator.iter_errors(document)
        ]
        # metadata is `type: object` in a CRD; the API server checks the name like any other.
        if not _dns_label_ok(document["metadata"]["name"], 253):
            errors.append(f"{name}: not a valid object name")
        return errors
    errors = []
    for version in KUBERNETES_VERSIONS:
        try:
            kubernetes_validate.validate(document, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            errors.append(f"{name} (Kubernetes {version}): {exc.message}")
    return errors


def _dns_label_ok(name: str, most: int) -> bool:
    return len(name) <= most and re.fullmatch(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?", name) is not None


@pytest.fixture(scope="module")
def everything() -> list[dict[str, Any]]:
    return render(EVERYTHING)


def test_helm_lint_finds_nothing_to_fix() -> None:
    report = helm.lint(str(CHART))
    assert report["errors"] == []
    # Severities: 1 info (e.g. "icon is recommended"), 2 warning, 3 error.
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


@pytest.mark.parametrize("case", ["defaults", "everything"])
def test_every_manifest_matches_its_schema(case: str, everything: list[dict[str, Any]]) -> None:
    documents = render({}) if case == "defaults" else everything
    kinds = {d["kind"] for d in documents}
    assert {"Deployment", "Service", "PodDisruptionBudget"} <= kinds
    if case == "everything":
        assert {"ScaledObject", "ServiceMonitor", "Role", "RoleBinding"} <= kinds
    errors = [error for document in documents for error in schema_errors(document)]
    assert errors == []


def test_the_schemas_catch_mistakes(everything: list[dict[str, Any]]) -> None:
    gateway = copy.deepcopy(of_kind(everything, "Deployment")["demo-sluice-gateway"])
    gateway["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["prt"] = 1
    assert any("prt" in e for e in schema_errors(gateway)), schema_errors(gateway)
    scaled = copy.deepcopy(next(iter(of_kind(everything, "ScaledObject").values())))
    scaled["spec"]["triggers"][0]["metadata"]["lagCount"] = 10  # KEDA wants strings
    scaled["spec"]["minReplicas"] = 0  # an HPA field, not KEDA's
    errors = schema_errors(scaled)
    assert any("lagCount" in e or "10 is not of type 'string'" in e for e in errors), errors
    assert any("minReplicas" in e for e in errors), errors
    monitor = copy.deepcopy(next(iter(of_kind(everything, "ServiceMonitor").values())))
    monitor["spec"]["endpoints"][0]["interval"] = "15 seconds"
    assert schema_errors(monitor)


def test_keda_scales_each_model_on_its_streams(everything: list[dict[str, Any]]) -> None:
    scaled = of_kind(everything, "ScaledObject")
    deployments = of_kind(everything, "Deployment")
    assert set(scaled) == {"demo-sluice-worker-iris-v1", "demo-sluice-worker-ranked-v2"}
    for name, document in scaled.items():
        assert document["spec"]["scaleTargetRef"] == {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "name": name,
        }
        assert name in deployments
        assert document["spec"]["minReplicaCount"] == 0  # scale to zero
    # The key layout of sluice/keys.py: <namespace>:req:{<model>}:<version>[:p<N>|:bg].
    streams = {
        name: [t["metadata"]["stream"] for t in d["spec"]["triggers"]] for name, d in scaled.items()
    }
    assert streams["demo-sluice-worker-iris-v1"] == [
        "prod:req:{iris}:1",
        "prod:req:{iris}:1",
        "prod:req:{iris}:1:bg",
        "prod:req:{iris}:1:bg",
    ]
    assert streams["demo-sluice-worker-ranked-v2"] == [
        "prod:req:{ranked}:2:p1",
        "prod:req:{ranked}:2:p1",
        "prod:req:{ranked}:2:p2",
        "prod:req:{ranked}:2:p2",
    ]
    lag, pending = scaled["demo-sluice-worker-iris-v1"]["spec"]["triggers"][:2]
    assert lag == {
        "type": "redis-cluster-streams",
        "metadata": {
            "addresses": "redis-0:6379,redis-1:6379,redis-2:6379",
            "enableTLS": "false",
            "stream": "prod:req:{iris}:1",
            "consumerGroup": "workers",
            "lagCount": "10",
            "activationLagCount": "0",
        },
        "authenticationRef": {"name": "sluice-redis-auth"},
    }
    assert pending["metadata"]["pendingEntriesCount"] == "10"
    assert "lagCount" not in pending["metadata"]  # KEDA reads one measure per trigger


def test_a_single_redis_uses_the_redis_streams_scaler() -> None:
    (scaled,) = of_kind(
        render({"models": [{"name": "iris", "version": 1}]}), "ScaledObject"
    ).values()
    for trigger in scaled["spec"]["triggers"]:
        assert trigger["type"] == "redis-streams"
        assert trigger["metadata"]["address"] == "redis:6379"
        assert trigger["metadata"]["databaseIndex"] == "0"
        assert trigger["metadata"]["stream"].startswith("sluice:req:{iris}:1")


def test_the_controller_scales_exactly_its_own_worker_deployments(
    everything: list[dict[str, Any]],
) -> None:
    controller = of_kind(everything, "Deployment")["demo-sluice-controller"]
    (container,) = controller["spec"]["template"]["spec"]["containers"]
    env = env_of(container)
    assert env["SLUICE_EXECUTOR"] == "kubernetes"
    assert env["SLUICE_KUBERNETES_NAMESPACE"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
    selector = env["SLUICE_KUBERNETES_SELECTOR"]
    assert container["command"] == [
        "sluice",
        "controller",
        "--model-repository",
        "s3://models/prod",
    ]

    workers = {
        name: d
        for name, d in of_kind(everything, "Deployment").items()
        if d["metadata"]["labels"].get("app.kubernetes.io/component") == "worker"
    }
    selected = {name for name, d in workers.items() if matches(d["metadata"]["labels"], selector)}
    assert selected == {"demo-sluice-worker-my-model-v2-v3-08f65f"}
    # The executor reads the exact model name and version from the annotations.
    (gpu_worker,) = (workers[name] for name in selected)
    view = SimpleNamespace(
        metadata=SimpleNamespace(annotations=gpu_worker["metadata"]["annotations"])
    )
    assert served_field(view) == "My_Model.v2:3"
    # Another release in the same namespace is not selected.
    other = render(EVERYTHING, release="other")
    assert not any(
        matches(d["metadata"]["labels"], selector) for d in of_kind(other, "Deployment").values()
    )
    # Its rollouts are followed for every worker Deployment of the release, however scaled.
    rollouts = env["SLUICE_KUBERNETES_ROLLOUT_SELECTOR"]
    followed = {n for n, d in workers.items() if matches(d["metadata"]["labels"], rollouts)}
    assert followed == set(workers) and len(followed) > 1
    assert not any(
        matches(d["metadata"]["labels"], rollouts) for d in of_kind(other, "Deployment").values()
    )

    (role,) = of_kind(everything, "Role").values()
    rules = {(tuple(r["resources"]), tuple(r["verbs"])) for r in role["rules"]}
    assert (("deployments",), ("get", "list", "watch")) in rules
    assert (("deployments/scale",), ("get", "patch", "update")) in rules
    (binding,) = of_kind(everything, "RoleBinding").values()
    assert (
        binding["subjects"][0]["name"]
        == controller["spec"]["template"]["spec"]["serviceAccountName"]
    )


def test_workers_run_one_model_version_each(everything: list[dict[str, Any]]) -> None:
    deployments = of_kind(everything, "Deployment")
    iris = deployments["demo-sluice-worker-iris-v1"]["spec"]["template"]["spec"]
    (init,) = iris["initContainers"]
    assert init["args" if "args" in init else "command"][-1] == "s3://models/prod"
    (worker,) = iris["containers"]
    assert worker["command"] == [
        "sluice",
        "worker",
        "--model",
        "iris",
        "--version",
        "1",
        "--model-repository",
        "/repository/current",
        "--kind",
        "KIND_CPU",
    ]
    env = env_of(worker)
    assert env["SLUICE_REDIS_URL"] == {"secretKeyRef": {"name": "sluice-redis", "key": "url"}}
    assert env["SLUICE_NAMESPACE"] == "prod"
    assert env["SLUICE_THREADS"] == "1"
    assert worker["envFrom"] == [{"secretRef": {"name": "models-s3"}}]
    shm = {v["name"]: v for v in iris["volumes"]}["shm"]
    assert shm["emptyDir"]["medium"] == "Memory"
    assert "nvidia.com/gpu" not in worker["resources"].get("limits", {})

    gpu = deployments["demo-sluice-worker-my-model-v2-v3-08f65f"]["spec"]["template"]["spec"]
    (worker,) = gpu["containers"]
    assert worker["image"] == "sluice-gpu:latest"
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert worker["command"][-4:] == ["--kind", "KIND_GPU", "--gpu", "0"]
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in gpu[
        "tolerations"
    ]
    assert deployments["demo-sluice-worker-fixed-v1"]["spec"]["replicas"] == 3


def test_gateways_are_probed_on_sluices_health_endpoints(everything: list[dict[str, Any]]) -> None:
    gateway = of_kind(everything, "Deployment")["demo-sluice-gateway"]["spec"]["template"]
    (container,) = gateway["spec"]["containers"]
    assert container["livenessProbe"]["httpGet"] == {"path": "/v2/health/live", "port": "http"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/v2/health/ready", "port": "http"}
    assert container["startupProbe"]["httpGet"]["path"] == "/v2/health/live"
    # A model scaled to zero must not take every gateway out of the Service.
    assert env_of(container)["SLUICE_STRICT_READINESS"] == "false"
    assert "0.0.0.0" in container["command"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"http": 8000, "grpc": 8001, "metrics": 8002}

    service = of_kind(everything, "Service")["demo-sluice-gateway"]
    pod_labels = gateway["metadata"]["labels"]
    assert matches(pod_labels, ",".join(f"{k}={v}" for k, v in service["spec"]["selector"].items()))
    (monitor,) = of_kind(everything, "ServiceMonitor").values()
    assert (
        monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    )
    assert monitor["spec"]["endpoints"][0]["port"] in {p["name"] for p in service["spec"]["ports"]}
    assert monitor["metadata"]["labels"]["release"] == "prometheus"


def test_every_disruption_budget_covers_the_pods_of_one_deployment(
    everything: list[dict[str, Any]],
) -> None:
    deployments = of_kind(everything, "Deployment")
    budgets = of_kind(everything, "PodDisruptionBudget")
    assert "demo-sluice-worker-fixed-v1" not in budgets  # turned off for that model
    assert set(budgets) == set(deployments) - {"demo-sluice-worker-fixed-v1"}
    for name, budget in budgets.items():
        selector = ",".join(
            f"{k}={v}" for k, v in budget["spec"]["selector"]["matchLabels"].items()
        )
        covered = {
            other
            for other, d in deployments.items()
            if matches(d["spec"]["template"]["metadata"]["labels"], selector)
        }
        assert covered == {name}, (name, covered)


def test_deployment_selectors_match_their_own_pods_only(everything: list[dict[str, Any]]) -> None:
    deployments = of_kind(everything, "Deployment")
    for name, deployment in deployments.items():
        selector = ",".join(
            f"{k}={v}" for k, v in deployment["spec"]["selector"]["matchLabels"].items()
        )
        owners = {
            other
            for other, d in deployments.items()
            if matches(d["spec"]["template"]["metadata"]["labels"], selector)
        }
        assert owners == {name}, (name, owners)


@pytest.mark.parametrize(
    ("model", "message"),
    [
        (
            {"name": "iris", "version": 1, "scaling": "magic"},
            "scaling must be keda, controller or none",
        ),
        ({"name": "iris", "version": "latest"}, "version must be a number"),
        ({"version": 1}, "every entry of models needs a name"),
    ],
)
def test_bad_values_are_refused_with_the_reason(model: dict[str, Any], message: str) -> None:
    with pytest.raises(helm.HelmError, match=message):
        render({"models": [model]})


# --------------------------------------------------------------------------- safe defaults


def pod_specs(documents: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {
        name: d["spec"]["template"]["spec"] for name, d in of_kind(documents, "Deployment").items()
    }


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A LabelSelector (matchLabels, matchExpressions with In) against a pod's labels."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expression in selector.get("matchExpressions", []):
        assert expression["operator"] == "In"
        if labels.get(expression["key"]) not in expression["values"]:
            return False
    return True


@pytest.mark.parametrize("case", ["defaults", "everything"])
def test_every_pod_is_locked_down(case: str, everything: list[dict[str, Any]]) -> None:
    documents = render({}) if case == "defaults" else everything
    specs = pod_specs(documents)
    assert len(specs) >= 4
    for name, spec in specs.items():
        pod = spec["securityContext"]
        assert pod["runAsNonRoot"] is True and pod["runAsUser"] != 0, name
        assert pod["seccompProfile"] == {"type": "RuntimeDefault"}, name
        controller = name.endswith("-controller")
        # Only the controller calls the Kubernetes API.
        assert spec["automountServiceAccountToken"] is controller, name
        volumes = {v["name"]: v for v in spec["volumes"]}
        for container in spec.get("initContainers", []) + spec["containers"]:
            where = f"{name}/{container['name']}"
            context = container["securityContext"]
            assert context["readOnlyRootFilesystem"] is True, where
            assert context["allowPrivilegeEscalation"] is False, where
            assert context["capabilities"] == {"drop": ["ALL"]}, where
            assert context["runAsNonRoot"] is True, where
            mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
            assert "emptyDir" in volumes[mounts["/tmp"]], where  # a writable /tmp
            if container["name"] == "worker":
                assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
    schema_problems = [e for d in documents for e in schema_errors(d)]
    assert schema_problems == []


def decoded(secret: dict[str, Any], key: str) -> str:
    return base64.b64decode(secret["data"][key]).decode()


def test_api_keys_come_from_a_secret_made_with_a_random_admin_key_by_default() -> None:
    documents = render({})
    (secret,) = of_kind(documents, "Secret").values()
    assert secret["metadata"]["name"] == "demo-sluice-api-keys"
    assert decoded(secret, "api-keys") == ""
    admin = decoded(secret, "admin-keys")
    assert re.fullmatch(r"admin:[A-Za-z0-9]{48}", admin), admin
    other = decoded(next(iter(of_kind(render({}), "Secret").values())), "admin-keys")
    assert other != admin  # random per install (an upgrade keeps the stored one: lookup)

    gateway = pod_specs(documents)["demo-sluice-gateway"]
    (container,) = gateway["containers"]
    env = env_of(container)
    assert env["SLUICE_API_KEYS_FILE"] == "/etc/sluice/keys/api-keys"
    assert env["SLUICE_ADMIN_KEYS_FILE"] == "/etc/sluice/keys/admin-keys"
    assert "SLUICE_API_KEYS" not in env and "SLUICE_ADMIN_KEYS" not in env
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    assert mounts["/etc/sluice/keys"]["readOnly"] is True
    volume = {v["name"]: v for v in gateway["volumes"]}[mounts["/etc/sluice/keys"]["name"]]
    assert volume["secret"]["secretName"] == "demo-sluice-api-keys"
    assert volume["secret"]["defaultMode"] == 0o440
    # No other pod gets the keys.
    for name, spec in pod_specs(documents).items():
        if name != "demo-sluice-gateway":
            assert not any("secret" in v for v in spec.get("volumes", [])), name


def test_api_keys_given_as_values_or_an_existing_secret() -> None:
    values = {"apiKeys": {"inference": ["team-a:k1", "team-b:k2"], "admin": ["ops:k3"]}}
    (secret,) = of_kind(render(values), "Secret").values()
    assert decoded(secret, "api-keys") == "team-a:k1\nteam-b:k2"
    assert decoded(secret, "admin-keys") == "ops:k3"
    # Inference keys alone: no admin key is made up (management stays closed).
    (secret,) = of_kind(render({"apiKeys": {"inference": ["t:k"]}}), "Secret").values()
    assert decoded(secret, "admin-keys") == ""

    documents = render({"apiKeys": {"existingSecret": "my-keys"}})
    assert of_kind(documents, "Secret") == {}
    gateway = pod_specs(documents)["demo-sluice-gateway"]
    secrets = [v["secret"]["secretName"] for v in gateway["volumes"] if "secret" in v]
    assert secrets == ["my-keys"]


def test_network_policies_open_the_gateway_only_and_guard_redis() -> None:
    documents = render(EVERYTHING)
    policies = of_kind(documents, "NetworkPolicy")
    assert set(policies) == {"demo-sluice-gateway", "demo-sluice-no-ingress", "demo-sluice-redis"}
    pods = {
        name: d["spec"]["template"]["metadata"]["labels"]
        for name, d in of_kind(documents, "Deployment").items()
    }

    def selected(policy: str) -> set[str]:
        selector = policies[policy]["spec"]["podSelector"]
        return {name for name, labels in pods.items() if selects(selector, labels)}

    assert selected("demo-sluice-gateway") == {"demo-sluice-gateway"}
    assert selected("demo-sluice-no-ingress") == set(pods) - {"demo-sluice-gateway"}
    closed = policies["demo-sluice-no-ingress"]["spec"]
    assert closed["policyTypes"] == ["Ingress"] and closed["ingress"] == []

    (rule,) = policies["demo-sluice-gateway"]["spec"]["ingress"]
    container = pod_specs(documents)["demo-sluice-gateway"]["containers"][0]
    assert {p["port"] for p in rule["ports"]} == {p["containerPort"] for p in container["ports"]}
    assert "from" not in rule  # anyone, unless networkPolicy.gateway.from says otherwise

    redis = policies["demo-sluice-redis"]["spec"]
    assert redis["podSelector"] == {"matchLabels": {"app.kubernetes.io/name": "redis"}}
    (rule,) = redis["ingress"]
    assert rule["ports"] == [{"port": 6379, "protocol": "TCP"}]
    peers = rule["from"]
    own, keda = peers
    assert all(selects(own["podSelector"], labels) for labels in pods.values())
    other_release = of_kind(render(EVERYTHING, release="other"), "Deployment")
    assert not any(
        selects(own["podSelector"], d["spec"]["template"]["metadata"]["labels"])
        for d in other_release.values()
    )
    assert keda == {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "keda"}}}

    limited = {"networkPolicy": {"gateway": {"from": [{"namespaceSelector": {}}]}}}
    (rule,) = of_kind(render(limited), "NetworkPolicy")["demo-sluice-gateway"]["spec"]["ingress"]
    assert rule["from"] == [{"namespaceSelector": {}}]
    no_redis = render({"networkPolicy": {"redis": {"enabled": False}}})
    assert "demo-sluice-redis" not in of_kind(no_redis, "NetworkPolicy")
    assert of_kind(render({"networkPolicy": {"enabled": False}}), "NetworkPolicy") == {}
