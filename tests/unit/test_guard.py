"""Which endpoints need which key (gateway.guard.KeyRing), without a server."""

from __future__ import annotations

import pytest

from gateway.guard import KeyRing

INFERENCE = "/v2/models/m/infer"
MANAGEMENT = [
    "/v2/repository/index",
    "/v2/systemsharedmemory/status",
    "/v2/cudasharedmemory/status",
]


def ring(inference: tuple[str, ...] = (), admin: tuple[str, ...] = ()) -> KeyRing:
    return KeyRing(frozenset(k.encode() for k in inference), frozenset(k.encode() for k in admin))


def test_no_keys_means_everything_is_open() -> None:
    assert ring().check(INFERENCE, None) is None
    assert ring().check(MANAGEMENT[0], None) is None


def test_admin_keys_alone_guard_management_only() -> None:
    keys = ring(admin=("root",))
    assert keys.check(INFERENCE, None) is None
    assert keys.check("/v2/models/m", None) is None
    assert keys.check("/v2", None) is None
    for path in MANAGEMENT:
        assert keys.check(path, None) == (
            401,
            "missing API key: send 'Authorization: Bearer <key>'",
        )
        assert keys.check(path, b"wrong") == (401, "invalid API key")
        assert keys.check(path, b"root") is None


def test_inference_keys_guard_everything_but_health() -> None:
    keys = ring(inference=("user",), admin=("root",))
    assert keys.check("/v2/health/ready", None) is None
    assert keys.check(INFERENCE, None) is not None
    assert keys.check(INFERENCE, b"user") is None
    assert keys.check(INFERENCE, b"root") is None
    assert keys.check(MANAGEMENT[0], b"user") == (
        403,
        "this key may not use management endpoints; use an admin key",
    )


@pytest.mark.parametrize("path", MANAGEMENT)
def test_inference_keys_alone_also_guard_management(path: str) -> None:
    keys = ring(inference=("user",))
    assert keys.check(path, None) is not None
    assert keys.check(path, b"user") is None
