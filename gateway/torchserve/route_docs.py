"""What FastAPI cannot see of TorchServe's routes, for their OpenAPI description
(:mod:`sluice.gateway.torchserve.api_description`), given beside each route as its
``openapi_extra``.

The routes read their query themselves, as TorchServe does: a number that is no number
takes its default (FastAPI's typed parameters would refuse it with 422), and a
registration's parameters may come as a JSON body instead. Their bodies are read raw
(a prediction's is the model's input, of any content type).
"""

from __future__ import annotations

from typing import Any, Literal

Kind = Literal["string", "integer", "boolean"]


def query(**parameters: tuple[Kind, str]) -> dict[str, Any]:
    """``openapi_extra`` naming a route's query parameters: name -> (type, description)."""
    return {
        "parameters": [
            {
                "name": name,
                "in": "query",
                "required": False,
                "description": description,
                "schema": {"type": kind},
            }
            for name, (kind, description) in parameters.items()
        ]
    }


def raw_body(description: str) -> dict[str, Any]:
    """``openapi_extra`` of a route whose body is taken as it is, of any content type."""
    return {
        "requestBody": {
            "description": description,
            "required": True,
            "content": {"*/*": {"schema": {"type": "string", "format": "binary"}}},
        }
    }


def json_body(description: str) -> dict[str, Any]:
    """``openapi_extra`` of a route that may take its parameters as a JSON object."""
    return {
        "requestBody": {
            "description": description,
            "required": False,
            "content": {"application/json": {"schema": {"type": "object"}}},
        }
    }
