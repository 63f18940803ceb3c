"""Triton's logging extension, ``GET`` / ``POST /v2/logging``, on a real stack: Triton's
names and texts, with tritonclient unchanged, and changes that show in the gateway's log."""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.support.onnx_models import write_identity
from tests.support.stack import Stack

DEFAULTS = {
    "log_file": "",
    "log_info": True,
    "log_warning": True,
    "log_error": True,
    "log_verbose_level": 0,
    "log_format": "default",
}


@pytest.fixture
def http(stack: Stack) -> Iterator[httpx.Client]:
    """The shared stack's gateway, its log settings put back afterwards. Several gateway
    processes share the port: a GET brings the one this connection reached up to date with
    the last change (the others follow at their next catalog refresh)."""
    with httpx.Client(base_url=stack.url, timeout=30) as client:
        assert client.get("/v2/logging").status_code == 200
        yield client
        restored = {key: value for key, value in DEFAULTS.items() if key != "log_file"}
        assert client.post("/v2/logging", json=restored).json() == DEFAULTS


def refused(http: httpx.Client) -> str:
    """Send a request the gateway refuses (404, logged at debug level); its id."""
    request_id = f"log-{uuid.uuid4().hex}"
    response = http.post(
        "/v2/models/no_such_model/infer", json={}, headers={"X-Request-ID": request_id}
    )
    assert response.status_code == 404
    return request_id


def logged(stack: Stack, request_id: str, timeout_s: float = 5.0) -> list[str]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        lines = [line for line in stack.stderr_lines if request_id in line]
        if lines:
            return lines
        time.sleep(0.05)
    return []


def test_get_answers_tritons_settings(stack: Stack) -> None:
    client = httpclient.InferenceServerClient(stack.address)
    assert client.get_log_settings() == DEFAULTS
    assert "logging" in client.get_server_metadata()["extensions"]


def test_post_changes_only_what_it_names(stack: Stack, http: httpx.Client) -> None:
    client = httpclient.InferenceServerClient(stack.address)
    assert client.update_log_settings({"log_verbose_level": 1}) == dict(
        DEFAULTS, log_verbose_level=1
    )
    changed = http.post("/v2/logging", json={"log_info": None, "unknown": 3, "log_error": False})
    assert changed.json() == dict(DEFAULTS, log_verbose_level=1, log_error=False)
    assert http.get("/v2/logging").json() == changed.json()


def test_verbose_level_and_format_change_the_gateways_log(stack: Stack, http: httpx.Client) -> None:
    quiet = refused(http)  # at level 0 its debug line is not written
    http.post("/v2/logging", json={"log_verbose_level": 1})
    loud = refused(http)
    [line] = logged(stack, loud)
    assert "DEBUG" in line and "404" in line and f"[request_id={loud}]" in line
    assert not [line for line in stack.stderr_lines if quiet in line]  # written in order

    http.post("/v2/logging", json={"log_format": "json"})
    [line] = logged(stack, refused(http))
    document = json.loads(line)
    assert document["level"] == "DEBUG" and document["role"] == "gateway"
    assert document["logger"] == "sluice.gateway.http.fast_path"
    assert document["request_id"].startswith("log-")

    http.post("/v2/logging", json={"log_format": "ISO8601"})
    [line] = logged(stack, refused(http))
    assert re.match(
        r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z gateway sluice\.gateway\.http\.fast_path DEBUG ",
        line,
    )


@pytest.mark.parametrize(
    ("body", "status", "error"),
    [
        (
            {"log_file": "/tmp/x.log"},
            501,
            "log file location can not be updated through network protocol",
        ),
        ({"log_file": ""}, 501, "log file location can not be updated through network protocol"),
        ({"log_info": "false"}, 400, "attempt to access JSON non-boolean as boolean"),
        ({"log_warning": 1}, 400, "attempt to access JSON non-boolean as boolean"),
        (
            {"log_verbose_level": -1},
            400,
            "attempt to access JSON non-unsigned-integer as unsigned-integer",
        ),
        (
            {"log_verbose_level": 1.5},
            400,
            "attempt to access JSON non-unsigned-integer as unsigned-integer",
        ),
        (
            {"log_verbose_level": True},
            400,
            "attempt to access JSON non-unsigned-integer as unsigned-integer",
        ),
        (
            {"log_verbose_level": 1 << 32},  # (a uint32 in Triton's protocol, and gRPC's)
            400,
            "log_verbose_level must be at most 4294967295 (a uint32, as Triton's protocol "
            "carries it); got 4294967296",
        ),
        ({"log_format": 8601}, 400, "attempt to access JSON non-string as string"),
        ({"log_format": "xml"}, 400, "invalid argument for --log_format, got: xml"),
        (
            {"log_info": False, "log_format": "xml"},
            400,
            "invalid argument for --log_format, got: xml",
        ),
    ],
)
def test_invalid_settings_answer_tritons_texts_and_change_nothing(
    http: httpx.Client, body: dict[str, object], status: int, error: str
) -> None:
    response = http.post("/v2/logging", json=body)
    assert (response.status_code, response.json()) == (status, {"error": error})
    assert http.get("/v2/logging").json() == DEFAULTS


def test_a_malformed_body_is_a_400(stack: Stack, http: httpx.Client) -> None:
    for body in (b"", b"{", b"[]"):
        response = http.post("/v2/logging", content=body)
        assert response.status_code == 400
        assert response.json()["error"].startswith("failed to parse the request JSON buffer: ")
    client = httpclient.InferenceServerClient(stack.address)
    with pytest.raises(InferenceServerException, match="non-boolean as boolean"):
        client.update_log_settings({"log_info": "yes"})


def test_logging_needs_an_admin_key_when_admin_keys_are_set(
    tmp_path: Path, start_stack: Callable[..., Stack]
) -> None:
    write_identity(tmp_path, "ident", ["FP32"])
    secured = start_stack(tmp_path, env={"SLUICE_API_KEYS": "user", "SLUICE_ADMIN_KEYS": "admin"})
    with httpx.Client(base_url=secured.url, timeout=10) as client:
        assert client.get("/v2/logging").status_code == 401
        user = {"Authorization": "Bearer user"}
        assert client.get("/v2/logging", headers=user).status_code == 403
        assert client.post("/v2/logging", json={"log_info": False}, headers=user).status_code == 403
        admin = {"Authorization": "Bearer admin"}
        assert client.get("/v2/logging", headers=admin).json() == DEFAULTS
