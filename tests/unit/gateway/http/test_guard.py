"""Which endpoints need which key, and whose tenant a key is (sluice.gateway.http.guard.KeyRing),
without a server; and the edge guard's check of Triton's restricted APIs."""

from __future__ import annotations

import json

import pytest
from starlette.types import Message, Receive, Scope, Send

from sluice.core.errors import InvalidConfig
from sluice.core.restricted_api import parse_restrictions
from sluice.core.settings import ApiKeySettings
from sluice.core.tenants import ANONYMOUS, parse_key_entry
from sluice.gateway.http.guard import EdgeGuard
from sluice.gateway.tenants.keys import KeyRing, is_management

INFERENCE = "/v2/models/m/infer"
MANAGEMENT = [
    "/v2/repository/index",
    "/v2/repository/models/m/load",
    "/v2/repository/models/m/routing",
    "/v2/systemsharedmemory/status",
    "/v2/cudasharedmemory/status",
    "/v2/logging",
    "/v2/trace/setting",
    "/v2/models/m/trace/setting",
    "/models",
    "/models/m/1",
    "/workflows",
    "/workflows/w",
]
NOT_MANAGEMENT = [
    INFERENCE,
    "/v2/models/m",
    "/v2/jobs/x",
    "/v2/batches",
    "/v2/models/trace",
    "/wfpredict/w",
]


def ring(inference: tuple[str, ...] = (), admin: tuple[str, ...] = ()) -> KeyRing:
    return KeyRing(
        tuple(parse_key_entry(k) for k in inference),
        tuple(parse_key_entry(k, "admin") for k in admin),
    )


@pytest.mark.parametrize("path", MANAGEMENT)
def test_management_routes(path: str) -> None:
    assert is_management(path)


@pytest.mark.parametrize("path", NOT_MANAGEMENT)
def test_other_routes(path: str) -> None:
    assert not is_management(path)


def test_no_keys_means_everything_is_open_to_one_tenant() -> None:
    assert ring().check(INFERENCE, None) is None
    assert ring().check(MANAGEMENT[0], None) is None
    assert ring().access(INFERENCE, b"anything").tenant == ANONYMOUS


def test_admin_keys_alone_guard_everything_but_health() -> None:
    """Defect: with only admin keys set, /v2/batches and every job route were open."""
    keys = ring(admin=("root",))
    assert keys.check("/v2/health/ready", None) is None
    for path in [INFERENCE, "/v2/batches", "/v2/jobs/0123", "/v2", *MANAGEMENT]:
        assert keys.check(path, None) == (
            401,
            "missing API key: send 'Authorization: Bearer <key>'",
        )
        assert keys.check(path, b"wrong") == (401, "invalid API key")
        assert keys.check(path, b"root") is None
    assert keys.access(INFERENCE, b"root").tenant == "admin"


def test_inference_keys_guard_everything_but_health() -> None:
    keys = ring(inference=("team-a:user",), admin=("ops:root",))
    assert keys.check("/v2/health/ready", None) is None
    assert keys.check(INFERENCE, None) is not None
    assert keys.access(INFERENCE, b"user").tenant == "team-a"
    assert keys.access(INFERENCE, b"root").tenant == "ops"
    assert keys.check(MANAGEMENT[0], b"user") == (
        403,
        "this key may not use management endpoints; use an admin key",
    )


@pytest.mark.parametrize("path", MANAGEMENT)
def test_inference_keys_alone_open_management_to_nobody(path: str) -> None:
    """Defect: with only inference keys set, every inference key could load models."""
    keys = ring(inference=("user",))
    assert keys.check(path, None) is not None
    assert keys.check(path, b"user") == (
        403,
        "management endpoints need an admin key, and none is set (SLUICE_ADMIN_KEYS)",
    )


def test_tenants_of_keys() -> None:
    keys = ring(inference=("a:k1", "a:k2", "b:k3", "bare-key"))
    assert keys.access(INFERENCE, b"k1").tenant == "a"
    assert keys.access(INFERENCE, b"k2").tenant == "a"
    assert keys.access(INFERENCE, b"k3").tenant == "b"
    bare = keys.access(INFERENCE, b"bare-key").tenant
    assert bare.startswith("key-") and "bare" not in bare


@pytest.mark.parametrize(
    "entry", ["a b:s3cr3t", ":s3cr3t", "-x:s3cr3t", "a" * 65 + ":s3cr3t", "team:"]
)
def test_bad_entries_are_refused_at_start_without_the_key(entry: str) -> None:
    settings = ApiKeySettings(api_keys=entry)
    with pytest.raises(InvalidConfig) as caught:
        KeyRing.from_settings(settings)
    assert "SLUICE_API_KEYS" in str(caught.value)
    assert "s3cr3t" not in str(caught.value)


async def _status(guard: EdgeGuard, path: str, headers: list[tuple[bytes, bytes]]) -> int:
    sent: list[Message] = []

    async def receive() -> Message:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: Message) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": path, "headers": headers}
    await guard(scope, receive, send)
    start = sent[0]
    if start["status"] == 403:
        assert json.loads(sent[1]["body"]) == {
            "error": "This API is restricted, expecting header 'admin-key'"
        }
    return int(start["status"])


async def test_a_restricted_api_needs_every_copy_of_its_header_to_agree() -> None:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    guard = EdgeGuard(
        app,
        ring(),
        max_header_count=100,
        max_header_bytes=1 << 16,
        max_control_body_bytes=1 << 20,
        restricted=parse_restrictions("model-repository:Admin-Key=secret"),
    )
    index = "/v2/repository/index"
    assert await _status(guard, index, []) == 403
    assert await _status(guard, index, [(b"admin-key", b"secre")]) == 403
    assert await _status(guard, index, [(b"admin-key", b"secret")]) == 200
    both = [(b"admin-key", b"secret"), (b"admin-key", b"secret")]
    assert await _status(guard, index, both) == 200
    for pairs in (
        [(b"admin-key", b"secret"), (b"admin-key", b"wrong")],
        [(b"admin-key", b"wrong"), (b"admin-key", b"secret")],
    ):
        assert await _status(guard, index, pairs) == 403
    assert await _status(guard, "/v2/models/m", []) == 200  # (another category)
