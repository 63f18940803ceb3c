"""The client regions a request uses stay registered while it runs, as in Triton: a request
holds a lease on each region its inputs and outputs name from the moment it is queued until
it ends (answered, failed, timed out or cancelled), so that unregistering one of them only
marks it draining, and its last user removes it (:mod:`sluice.gateway.shm.store`).

:func:`holding_regions` and :func:`holding_regions_stream` wrap the inference path's
:func:`sluice.gateway.inference.data_plane.execute` and
:func:`sluice.gateway.inference.data_plane.execute_stream`, which every route (REST, gRPC,
generate, TorchServe's) goes through. A request that names no region costs nothing; one that
does costs a Redis round trip as it starts and one as it ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any, Concatenate, ParamSpec, Protocol, TypeVar

from redis.exceptions import RedisError

from sluice.gateway.inference.request import InferRequest
from sluice.gateway.shm.registry import Lease, RegionRegistry, RegionUse
from sluice.gateway.state import GatewayState

log = logging.getLogger(__name__)


class RunningRequest(Protocol):
    """A request on its way to the workers
    (:class:`sluice.gateway.inference.data_plane.Prepared`)."""

    parsed: InferRequest
    timeout_us: int


P = ParamSpec("P")
T = TypeVar("T")
Y = TypeVar("Y")
R = TypeVar("R", bound=RunningRequest)


def region_uses(parsed: InferRequest) -> list[RegionUse]:
    """The request's references to client regions: its inputs' and its outputs'."""
    uses = [
        RegionUse(f"input '{tensor.name}'", tensor.region, tensor.shm)
        for tensor in parsed.inputs
        if tensor.shm is not None
    ]
    uses.extend(
        RegionUse(f"output '{output.name}'", output.region, output.shm)
        for output in parsed.outputs
        if output.shm is not None
    )
    return uses


@contextlib.asynccontextmanager
async def regions_held(
    regions: RegionRegistry, uses: list[RegionUse], timeout_us: int
) -> AsyncIterator[None]:
    """The regions of ``uses`` (a request's, :func:`region_uses`) stay registered until the
    block ends (or the request's ``timeout_us``, should this process die meanwhile)."""
    lease = await regions.hold(uses, timeout_us / 1_000_000)
    try:
        yield
    finally:
        if lease is not None:
            # Shielded: a cancelled request still gives its regions back now.
            await asyncio.shield(_release(regions, lease))


async def _release(regions: RegionRegistry, lease: Lease) -> None:
    try:
        await regions.release(lease)
    except RedisError as exc:  # (the answer stands; the lease lapses at the deadline)
        log.warning(
            "releasing shared memory regions %s failed (%s): unregistered, they go at the "
            "request's deadline",
            ", ".join(repr(name) for name in lease.names),
            exc,
        )


def holding_regions(
    run: Callable[Concatenate[GatewayState, R, P], Awaitable[T]],
) -> Callable[Concatenate[GatewayState, R, P], Coroutine[Any, Any, T]]:
    """``run(state, request, ...)`` with the request's regions held while it runs."""

    @functools.wraps(run)
    async def held(state: GatewayState, request: R, /, *args: P.args, **kwargs: P.kwargs) -> T:
        uses = region_uses(request.parsed)
        if not uses:  # (most requests: nothing to hold, not even a context)
            return await run(state, request, *args, **kwargs)
        async with regions_held(state.regions, uses, request.timeout_us):
            return await run(state, request, *args, **kwargs)

    return held


def holding_regions_stream(
    run: Callable[Concatenate[GatewayState, R, P], AsyncGenerator[Y, None]],
) -> Callable[Concatenate[GatewayState, R, P], AsyncGenerator[Y, None]]:
    """:func:`holding_regions` for a stream of responses: held until the last one, or
    until the consumer closes the stream."""

    @functools.wraps(run)
    async def held(
        state: GatewayState, request: R, /, *args: P.args, **kwargs: P.kwargs
    ) -> AsyncGenerator[Y, None]:
        async with (
            regions_held(state.regions, region_uses(request.parsed), request.timeout_us),
            contextlib.aclosing(run(state, request, *args, **kwargs)) as items,
        ):
            async for item in items:
                yield item

    return held
