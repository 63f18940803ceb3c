"""compose.yaml's safe defaults, read from the file (the live test runs them under podman),
and scripts/compose-env.sh, which makes the .env they need.

Rules: nothing published beyond loopback; no service starts without the generated secrets;
MinIO's root credentials only in minio and minio-init; each Sluice service its own MinIO
user, whose policy reaches its one bucket; Redis with a password and bounded memory; every
container not root (but a one-shot chown), read-only, without capabilities or new privileges;
Grafana's password from .env and no anonymous access.
"""

from __future__ import annotations

import json
import re
import stat
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from sluice.core.tenants import parse_key_entry

ROOT = Path(__file__).resolve().parents[3]
COMPOSE = ROOT / "compose.yaml"
TEST_OVERRIDE = ROOT / "deploy" / "compose.test.yaml"
ENV_SCRIPT = ROOT / "scripts" / "compose-env.sh"
POLICIES = ROOT / "deploy" / "minio"
VARIABLE = re.compile(r"\$\{([A-Z0-9_]+)(?::?([-?])([^}]*))?\}")
ROOT_CREDENTIALS = {"MINIO_ROOT_USER", "MINIO_ROOT_PASSWORD"}
CHOWN_ONLY = "volumes-init"
"""The one service running as root: a one-shot chown of MinIO's new volume."""


def services(path: Path = COMPOSE) -> dict[str, dict[str, Any]]:
    loaded: dict[str, dict[str, Any]] = yaml.safe_load(path.read_text())["services"]
    return loaded


def variables(value: Any) -> list[tuple[str, str, str]]:
    """Every ${NAME...} in a value: (name, operator, message or default)."""
    return [(m[0], m[1], m[2]) for m in VARIABLE.findall(json.dumps(value))]


def environment(service: dict[str, Any]) -> dict[str, str]:
    return {k: str(v) for k, v in (service.get("environment") or {}).items()}


def test_nothing_is_published_beyond_loopback() -> None:
    published = 0
    for name, service in services().items():
        for port in service.get("ports", []):
            assert isinstance(port, str) and port.startswith("127.0.0.1:"), (name, port)
            published += 1
    assert published == 5


def test_every_secret_comes_from_env_or_compose_refuses_to_start() -> None:
    """A secret has no default: ``${VAR:?...}`` stops compose with what to run."""
    text = COMPOSE.read_text()
    used = {name: (op, rest) for name, op, rest in variables(yaml.safe_load(text))}
    secrets = {n for n in used if re.search(r"PASSWORD|SECRET|KEY|ROOT_USER", n)}
    assert secrets >= ROOT_CREDENTIALS | {"REDIS_PASSWORD", "SLUICE_API_KEYS"}
    for name in secrets:
        operator, message = used[name]
        assert operator == "?", f"{name} has a default"
        assert "run scripts/compose-env.sh" in message, name
    assert "admin/admin" not in text and ":-sluice-minio}" not in text


def test_minio_root_credentials_stay_in_minio_and_its_init() -> None:
    holders = {
        name
        for name, service in services().items()
        if ROOT_CREDENTIALS & {v[0] for v in variables(service)}
    }
    assert holders == {"minio", "minio-init"}


@pytest.mark.parametrize(
    ("service", "user", "bucket", "writes"),
    [
        ("workers", "MODELS_READER", "models", False),
        ("workers-gpu", "MODELS_READER", "models", False),
        ("controller", "MODELS_READER", "models", False),
        ("models-upload", "MODELS_UPLOADER", "models", True),
        ("gateway", "BATCH_STORE", "batches", True),
        ("batch-worker", "BATCH_STORE", "batches", True),
    ],
)
def test_each_service_has_its_own_least_privileged_minio_user(
    service: str, user: str, bucket: str, writes: bool
) -> None:
    env = environment(services()[service])
    assert env["AWS_ACCESS_KEY_ID"].startswith(f"${{{user}_ACCESS_KEY:?")
    assert env["AWS_SECRET_ACCESS_KEY"].startswith(f"${{{user}_SECRET_KEY:?")
    init = environment(services()["minio-init"])
    assert f"{user}_ACCESS_KEY" in init and f"{user}_SECRET_KEY" in init
    policy = {"MODELS_READER": "models-read", "MODELS_UPLOADER": "models-write"}.get(
        user, "batch-store"
    )
    actions, resources = policy_grants(policy)
    assert resources == {f"arn:aws:s3:::{bucket}", f"arn:aws:s3:::{bucket}/*"}
    assert ("s3:PutObject" in actions) is writes
    assert "s3:GetObject" in actions
    assert not {a for a in actions if a.startswith("s3:") and "*" in a}
    assert not actions & {"s3:CreateBucket", "s3:DeleteBucket", "s3:PutBucketPolicy"}
    if service in ("gateway", "batch-worker"):
        assert env["SLUICE_BATCH_STORE"] == "s3://batches/"


def policy_grants(name: str) -> tuple[set[str], set[str]]:
    policy = json.loads((POLICIES / f"{name}.json").read_text())
    actions: set[str] = set()
    resources: set[str] = set()
    for statement in policy["Statement"]:
        assert statement["Effect"] == "Allow"
        actions |= set(statement["Action"])
        resources |= set(statement["Resource"])
    return actions, resources


def test_minio_init_makes_every_policy_and_user() -> None:
    script = (POLICIES / "init.sh").read_text()
    for policy in ("models-read", "models-write", "batch-store"):
        assert (POLICIES / f"{policy}.json").exists()
        assert policy in script
    for user in ("MODELS_READER", "MODELS_UPLOADER", "BATCH_STORE"):
        assert f'user "${user}_ACCESS_KEY" "${user}_SECRET_KEY"' in script
    init = services()["minio-init"]
    assert init["depends_on"]["minio"]["condition"] == "service_healthy"
    assert "./deploy/minio:/sluice-minio:ro" in init["volumes"]


def test_redis_needs_a_password_and_bounds_its_memory() -> None:
    redis = services()["redis"]
    command = redis["command"]
    option = dict(zip(command[1::2], command[2::2], strict=True))
    assert option["--requirepass"].startswith("${REDIS_PASSWORD:?")
    assert option["--maxmemory"] == "${REDIS_MAXMEMORY:-1gb}"
    assert option["--maxmemory-policy"] == "noeviction"
    assert option["--appendonly"] == "yes"
    assert environment(redis)["REDISCLI_AUTH"].startswith("${REDIS_PASSWORD:?")
    for name, service in services().items():
        for key, value in environment(service).items():
            if key == "SLUICE_REDIS_URL":
                assert value.startswith("redis://:${REDIS_PASSWORD:?"), name
        # Arguments are in every process list: the URL travels in the environment only.
        assert "--redis-url" not in json.dumps(service.get("command", [])), name


@pytest.mark.parametrize("path", [COMPOSE, TEST_OVERRIDE], ids=lambda p: p.name)
def test_every_container_is_not_root_read_only_and_without_capabilities(path: Path) -> None:
    merged = services(COMPOSE)
    if path == TEST_OVERRIDE:
        for name, override in services(TEST_OVERRIDE).items():
            merged[name] = {**merged[name], **override}
    for name, service in merged.items():
        assert service.get("read_only") is True, name
        assert service.get("cap_drop") == ["ALL"], name
        assert "no-new-privileges" in service.get("security_opt", []), name
        assert "/tmp" in service.get("tmpfs", []), name
        user = str(service.get("user", ""))
        if name == CHOWN_ONLY:
            assert user == "0:0" and service["cap_add"] == ["CHOWN"]
            assert service["command"][0] == "chown" and service["restart"] == "on-failure"
        else:
            assert user and user.split(":")[0] not in ("0", "root"), (name, user)
            assert "cap_add" not in service, name
            assert "privileged" not in service, name


def test_grafana_password_from_env_and_no_anonymous_access() -> None:
    env = environment(services()["grafana"])
    assert env["GF_SECURITY_ADMIN_PASSWORD"].startswith("${GRAFANA_ADMIN_PASSWORD:?")
    assert env["GF_AUTH_ANONYMOUS_ENABLED"] == "false"
    assert env["GF_USERS_ALLOW_SIGN_UP"] == "false"


def test_the_gateway_requires_keys_and_prometheus_has_its_own() -> None:
    gateway = environment(services()["gateway"])
    assert gateway["SLUICE_API_KEYS"].startswith("${SLUICE_API_KEYS:?")
    assert gateway["SLUICE_API_KEYS"].endswith(
        ",prometheus:${SLUICE_METRICS_KEY:?" + "no .env - run scripts/compose-env.sh first}"
    )
    assert gateway["SLUICE_ADMIN_KEYS"].startswith("${SLUICE_ADMIN_KEYS:?")
    prometheus = services()["prometheus"]
    assert "/run/sluice" in prometheus["tmpfs"]
    assert "/run/sluice/metrics-key" in prometheus["entrypoint"][2]
    assert "$$SLUICE_METRICS_KEY" in prometheus["entrypoint"][2]


# --------------------------------------------------------------------------- the generator


def generate(output: Path, *tenants: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["sh", str(ENV_SCRIPT), "--output", str(output), *tenants],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


def generated_env(path: Path) -> dict[str, str]:
    return dict(
        line.split("=", 1)
        for line in path.read_text().splitlines()
        if line.strip() and not line.startswith("#")
    )


def test_the_generator_makes_every_variable_compose_needs(tmp_path: Path) -> None:
    output = tmp_path / ".env"
    done = generate(output, "team-a", "team.b")
    assert done.returncode == 0, done.stderr
    env = generated_env(output)
    needed = {name for name, op, _ in variables(yaml.safe_load(COMPOSE.read_text())) if op == "?"}
    assert needed and needed <= set(env), needed - set(env)
    assert stat.S_IMODE(output.stat().st_mode) == 0o600
    assert not list(tmp_path.glob(".env.*")), "the draft was left behind"
    # Nothing secret is printed.
    for value in env.values():
        if len(value) >= 32:
            assert value not in done.stdout + done.stderr

    entries = [parse_key_entry(e) for e in env["SLUICE_API_KEYS"].split(",")]
    assert [e.tenant for e in entries] == ["team-a", "team.b"]
    assert parse_key_entry(env["SLUICE_ADMIN_KEYS"]).tenant == "admin"
    for name in ("REDIS_PASSWORD", "SLUICE_METRICS_KEY", "GRAFANA_ADMIN_PASSWORD"):
        assert re.fullmatch(r"[0-9a-f]{64}", env[name]), name
    for entry in entries:
        assert re.fullmatch(rb"[0-9a-f]{64}", entry.key)
    # MinIO: access keys of at most 20 characters, secret keys of 40 (160 random bits).
    for user in ("MINIO_ROOT", "MODELS_READER", "MODELS_UPLOADER", "BATCH_STORE"):
        access = env["MINIO_ROOT_USER"] if user == "MINIO_ROOT" else env[f"{user}_ACCESS_KEY"]
        secret = env["MINIO_ROOT_PASSWORD"] if user == "MINIO_ROOT" else env[f"{user}_SECRET_KEY"]
        assert 3 <= len(access) <= 20, access
        assert re.fullmatch(r"[0-9a-f]{40}", secret), user
    secrets = [v for k, v in env.items() if re.search(r"PASSWORD|SECRET", k)]
    assert len(set(secrets)) == len(secrets)
    # Another run makes other secrets.
    again = tmp_path / "again.env"
    assert generate(again).returncode == 0
    other = generated_env(again)
    assert other["REDIS_PASSWORD"] != env["REDIS_PASSWORD"]
    assert other["SLUICE_API_KEYS"].startswith("demo:")


def test_the_generator_never_overwrites(tmp_path: Path) -> None:
    output = tmp_path / ".env"
    output.write_text("REDIS_PASSWORD=mine\n")
    output.chmod(0o640)
    done = generate(output)
    assert done.returncode == 0
    assert "kept as it is" in done.stderr
    assert output.read_text() == "REDIS_PASSWORD=mine\n"
    assert stat.S_IMODE(output.stat().st_mode) == 0o640
    # Nor through a link.
    target = tmp_path / "elsewhere"
    target.write_text("untouched\n")
    link = tmp_path / "link.env"
    link.symlink_to(target)
    assert generate(link).returncode == 0
    assert target.read_text() == "untouched\n"


@pytest.mark.parametrize("tenant", ["-x", "a b", "a/b", "a:b", "", "x" * 65, "admin"])
def test_the_generator_refuses_bad_tenant_names(tmp_path: Path, tenant: str) -> None:
    output = tmp_path / ".env"
    done = generate(output, tenant)
    assert done.returncode == 2
    assert "tenant" in done.stderr.lower()
    assert not output.exists()
