"""Triton's logging extension across gateway processes (sluice.gateway.control.log_settings),
on a real Redis: what a change stores is what every process (and gRPC) can read back, and
a change reaches the processes that followed an earlier one, whatever Redis lost between."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from dataclasses import replace

import pytest
from redis.asyncio import Redis

from sluice.core.errors import InvalidInput
from sluice.core.keys import Keys
from sluice.core.observability.logs import control
from sluice.gateway.control import log_settings
from sluice.gateway.control.log_settings import (
    change_log_settings,
    follow_log_settings,
    log_changes,
)
from sluice.gateway.grpc_api.protocol import service_pb2
from sluice.gateway.grpc_api.service import ControlCalls
from sluice.gateway.state import GatewayState
from sluice.scheduler.executor.redis_server import RedisServer
from tests.support.onnx_models import identity_config
from tests.unit.gateway.in_process import EchoDispatcher, in_process_gateway

UINT32_MAX = (1 << 32) - 1


@pytest.fixture
async def state(redis_server: RedisServer) -> AsyncIterator[GatewayState]:
    """An in-process gateway whose log settings live in the tests' Redis, under a namespace
    of its own; this process starts having followed nothing."""
    config = identity_config("ident", ["FP32"], [-1], 8)
    app = in_process_gateway("ident", config, EchoDispatcher(["OUT_FP32"]))
    gateway: GatewayState = app.app.state.sluice
    client = Redis.from_url(redis_server.url)
    gateway.redis, gateway.keys = client, Keys(f"t{uuid.uuid4().hex[:8]}")
    followed = log_settings._followed
    log_settings._followed = log_settings._Followed()
    yield gateway
    log_settings._followed = followed
    await client.aclose()


async def test_a_verbose_level_past_uint32_is_refused_so_grpc_can_report_every_level(
    state: GatewayState,
) -> None:
    """Triton's protocol carries the level as a uint32 (gRPC's ``uint32_param``): a larger
    one sent over REST would be stored for every process, and every gRPC LogSettings call
    after it would fail (INTERNAL) until changed again."""
    for level in (UINT32_MAX + 1, (1 << 64) - 1):
        with pytest.raises(InvalidInput, match="log_verbose_level") as refused:
            log_changes({"log_verbose_level": level})
        assert str(UINT32_MAX) in refused.value.message
    await change_log_settings(state, log_changes({"log_verbose_level": UINT32_MAX}))
    response = await ControlCalls(state).LogSettings(service_pb2.LogSettingsRequest())
    assert response.settings["log_verbose_level"].uint32_param == UINT32_MAX


async def test_a_change_after_redis_lost_the_settings_reaches_a_process_that_followed_before(
    state: GatewayState,
) -> None:
    """Redis restarted, or a replica that had not seen the last change took over: the next
    change starts the stored settings anew. A process that followed the lost ones must still
    apply it (it used to compare revision numbers alone, and the new one repeats the old)."""
    await change_log_settings(state, {"info": False})
    # Another gateway process: it followed that change...
    other_options, other_followed = control().options, replace(log_settings._followed)
    await state.redis.delete(state.keys.log_settings)  # ...then Redis lost it
    await change_log_settings(state, {"verbose_level": 1})  # a change through this process
    assert control().options.verbose_level == 1
    # The other process catches up at its next refresh.
    control().update(
        info=other_options.info,
        warning=other_options.warning,
        error=other_options.error,
        verbose_level=other_options.verbose_level,
        format=other_options.format,
    )
    log_settings._followed = other_followed
    await follow_log_settings(state)
    assert control().options.verbose_level == 1


async def test_stored_settings_no_process_could_apply_are_skipped_not_raised(
    state: GatewayState,
) -> None:
    """A value another version wrote, or one past the uint32 range stored before it was
    refused: the other settings apply, and neither the refresh nor a GET fails on it (the
    refresh renews what it reads, so a failure would last as long as the gateways)."""
    await state.redis.hset(
        state.keys.log_settings,
        mapping={
            "rev": "x",
            "info": "0",
            "verbose_level": str(1 << 40),
            "format": b"\xff",
            "warning": "maybe",
        },
    )
    await follow_log_settings(state)
    options = (await change_log_settings(state, {})).as_triton()
    assert options["log_info"] is False
    assert options["log_verbose_level"] == 0 and options["log_warning"] is True
    response = await ControlCalls(state).LogSettings(service_pb2.LogSettingsRequest())
    assert response.settings["log_info"].bool_param is False
