"""TorchServe's API descriptions cut from the gateway's route table: a port's document has
the routes its filter lets through and stands alone (the components they refer to come
along), and a model's names the model in its paths."""

from __future__ import annotations

from typing import Any

from sluice.core.settings import GatewaySettings
from sluice.gateway.app import create_app
from sluice.gateway.torchserve.api_description import model_document, port_document
from sluice.gateway.torchserve.ports import TorchServePort, inference_path, management_path


def _schema() -> dict[str, Any]:
    port = create_app(GatewaySettings()).torchserve_inference
    assert isinstance(port, TorchServePort)
    return port.routes.openapi()


def _refs(node: Any) -> set[str]:
    if isinstance(node, dict):
        found = {node["$ref"]} if isinstance(node.get("$ref"), str) else set()
        return found.union(*(_refs(value) for value in node.values()))
    if isinstance(node, list):
        return set().union(*(_refs(value) for value in node))
    return set()


def test_a_port_document_stands_alone_with_the_components_it_refers_to() -> None:
    schema = {
        "openapi": "3.1.0",
        "paths": {
            "/models": {"get": {"responses": {"200": {"$ref": "#/components/schemas/A"}}}},
            "/v2/repository/index": {"post": {"$ref": "#/components/schemas/C"}},
        },
        "components": {
            "schemas": {
                "A": {"properties": {"b": {"$ref": "#/components/schemas/B"}}},
                "B": {"type": "string"},
                "C": {"type": "integer"},
            }
        },
    }
    document = port_document(schema, management_path)
    assert list(document["paths"]) == ["/", "/models", "/api-description"]
    assert sorted(document["components"]["schemas"]) == ["A", "B"]


def test_every_reference_of_the_gateway_s_port_documents_resolves() -> None:
    for served in (inference_path, management_path):
        document = port_document(_schema(), served)
        defined = {f"#/components/schemas/{name}" for name in document["components"]["schemas"]}
        assert _refs(document) <= defined


def test_a_model_document_names_the_model_in_its_paths() -> None:
    document = model_document(_schema(), inference_path, "a b/c", "RESTful API for: ")
    assert document["info"]["title"] == "RESTful API for: a b/c"
    paths = document["paths"]
    assert "/predictions/a%20b%2Fc" in paths and "/v2/models/a%20b%2Fc/infer" in paths
    assert {"/explanations/a%20b%2Fc", "/v1/models/a%20b%2Fc:explain"} <= set(paths)
    assert all("/a%20b%2Fc" in path and "{model}" not in path for path in paths)
    infer = paths["/v2/models/a%20b%2Fc/versions/{version}/infer"]["post"]
    assert [p["name"] for p in infer["parameters"]] == ["version"]
    assert "parameters" not in paths["/v2/models/a%20b%2Fc/infer"]["post"]
    # (routes that name no model, or another port's, are not the model's)
    assert "/v2/models/stats" not in paths and not any(p.startswith("/models/") for p in paths)
