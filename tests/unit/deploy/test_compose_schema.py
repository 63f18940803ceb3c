"""compose.yaml (and the live test's override) against the Compose Specification's schema.

The schema is vendored in tests/data/compose-spec.json (see tests/data/README.md): nothing is
downloaded. YAML anchors and merge keys are resolved by the loader, as Compose does.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[3]
SCHEMA = ROOT / "tests" / "data" / "compose-spec.json"
COMPOSE = ROOT / "compose.yaml"
TEST_OVERRIDE = ROOT / "deploy" / "compose.test.yaml"


def _load(path: Path) -> dict[str, Any]:
    document = yaml.safe_load(path.read_text())
    assert isinstance(document, dict), f"{path.name}: not a mapping"
    return document


def _errors(document: dict[str, Any]) -> list[str]:
    schema = json.loads(SCHEMA.read_text())
    validator = jsonschema.Draft7Validator(schema)
    return [
        f"{'/'.join(map(str, error.absolute_path)) or '(top)'}: {error.message}"
        for error in sorted(validator.iter_errors(document), key=lambda e: list(e.path))
    ]


@pytest.mark.parametrize("path", [COMPOSE, TEST_OVERRIDE], ids=lambda p: p.name)
def test_compose_file_matches_the_compose_specification(path: Path) -> None:
    errors = _errors(_load(path))
    assert not errors, f"{path.name} breaks the Compose Specification:\n" + "\n".join(errors)


def test_the_schema_catches_a_mistake() -> None:
    """The vendored schema really checks services (an unknown key is refused)."""
    document = _load(COMPOSE)
    document["services"]["gateway"]["helthcheck"] = {"test": ["CMD", "true"]}
    assert any("helthcheck" in error for error in _errors(document))


def test_stack_shape() -> None:
    """What docs/operations/compose.md promises: services, loopback ports, health-gated start-up."""
    services = _load(COMPOSE)["services"]
    assert {
        "redis",
        "minio",
        "models-upload",
        "workers",
        "workers-gpu",
        "gateway",
        "prometheus",
        "grafana",
    } <= set(services)
    for name, service in services.items():
        for port in service.get("ports", []):
            assert str(port).startswith("127.0.0.1:"), f"{name} publishes {port} beyond loopback"
    assert services["gateway"]["depends_on"]["redis"]["condition"] == "service_healthy"
    assert services["workers"]["depends_on"]["redis"]["condition"] == "service_healthy"
    # MinIO's users and buckets are made first, then the upload runs as its own user.
    assert services["minio-init"]["depends_on"]["minio"]["condition"] == "service_healthy"
    upload_after = services["models-upload"]["depends_on"]["minio-init"]["condition"]
    assert upload_after == "service_completed_successfully"
    assert "--no-gateway" in services["workers"]["command"]
    assert "--metrics-port" in services["gateway"]["command"]
    assert services["workers-gpu"]["profiles"] == ["gpu"]
    devices = services["workers-gpu"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["capabilities"] == ["gpu"]
    assert "--appendonly" in services["redis"]["command"]
    for name in ("workers", "gateway", "models-upload"):
        assert services[name]["init"] is True, name
