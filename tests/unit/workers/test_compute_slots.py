"""The gate of a worker whose backend computes several batches at once."""

from __future__ import annotations

import asyncio

import pytest

from sluice.core.errors import InvalidConfig
from sluice.workers.slots import ComputeSlots, backend_concurrency


def test_slots_gate_like_an_event_with_a_count() -> None:
    async def scenario() -> None:
        slots = ComputeSlots(2)
        assert slots.is_set()
        slots.clear()
        assert slots.is_set()
        slots.clear()
        assert not slots.is_set()
        waiter = asyncio.create_task(slots.wait())
        await asyncio.sleep(0.01)
        assert not waiter.done()
        slots.set()
        assert await asyncio.wait_for(waiter, 1.0)
        assert slots.is_set()

    asyncio.run(scenario())


class _Plain:
    pass


class _Concurrent:
    concurrency = 64


class _Bad:
    concurrency = 0


def test_backend_concurrency_defaults_to_one_and_is_checked() -> None:
    assert backend_concurrency(_Plain()) == 1
    assert backend_concurrency(_Concurrent()) == 64
    with pytest.raises(InvalidConfig, match="concurrency must be an integer from 1"):
        backend_concurrency(_Bad())
