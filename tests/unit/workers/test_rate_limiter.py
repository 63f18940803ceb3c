"""Triton's rate limiter: the resource counts the command line gives, the configuration's
``rate_limiter``, and the workers' holds on a real Redis (all of an instance's resources or
none, the default count, a holder that died)."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from redis.asyncio import Redis

from sluice.core.config import parse_config_text
from sluice.core.errors import InvalidConfig
from sluice.core.keys import Keys
from sluice.core.placement import Placement
from sluice.core.rate_limit import parse_resource_counts
from sluice.core.settings import RateLimitSettings
from sluice.scheduler.executor.redis_server import RedisServer
from sluice.workers import rate_limiter
from sluice.workers.rate_limiter import RateLimiter, group_of, rate_limiter_for

CONFIG = """name: "m"
backend: "python"
max_batch_size: 1
input [ { name: "X" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "Y" data_type: TYPE_FP32 dims: [ 1 ] } ]
instance_group [
  { count: 2 kind: KIND_CPU
    rate_limiter { resources [ { name: "R1" count: 2 }, { name: "G" global: true count: 1 } ]
                   priority: 2 } },
  { count: 1 kind: KIND_CPU }
]
"""


def test_resource_counts_as_the_command_line_gives_them() -> None:
    counts = parse_resource_counts("R1:10, R2:5:0,R2:8:1")
    assert counts.given("R1", 0) == 10 and counts.given("R1", 3) == 10
    assert counts.given("R1", None) == 10  # (a global resource)
    assert counts.given("R2", 0) == 5 and counts.given("R2", 1) == 8
    assert counts.given("R2", 2) is None and counts.given("R3", 0) is None
    for bad in ("R1", "R1:", ":3", "R1:-1", "R1:2:x", "R1:2:0:9", "R 1:2"):
        with pytest.raises(ValueError):
            parse_resource_counts(bad)


def test_the_configuration_says_what_each_group_needs() -> None:
    config = parse_config_text(CONFIG, model_name="m")
    first, second = config.instance_groups
    assert first.rate_limiter is not None and second.rate_limiter is None
    assert [(r.name, r.count, r.global_) for r in first.rate_limiter.resources] == [
        ("R1", 2, False),
        ("G", 1, True),
    ]
    assert first.rate_limiter.priority == 2
    assert group_of(config.instance_groups, 1) is first
    assert group_of(config.instance_groups, 2) is second
    assert group_of(config.instance_groups, 7) is second  # (added by autoscaling)
    for resources, reason in (
        ('[ { name: "" count: 1 } ]', "name must not be empty"),
        ('[ { name: "R" count: 1 }, { name: "R" count: 2 } ]', "'R' is listed more than once"),
    ):
        bad = CONFIG.replace(
            '[ { name: "R1" count: 2 }, { name: "G" global: true count: 1 } ]', resources
        )
        with pytest.raises(InvalidConfig, match=reason):
            parse_config_text(bad, model_name="m")


def test_an_instance_needing_more_than_given_cannot_load(redis_server: RedisServer) -> None:
    config = parse_config_text(CONFIG, model_name="m")
    redis = Redis.from_url(redis_server.url)
    keys, cpu = Keys("rl"), Placement()

    def limiter(mode: str, resources: str, slot: int = 0) -> RateLimiter | None:
        settings = RateLimitSettings(rate_limit=mode, rate_limit_resources=resources)
        return rate_limiter_for(redis, keys, settings, config, slot, cpu, "host", "w")

    assert limiter("off", "") is None
    assert limiter("execution_count", "", slot=2) is None  # its group lists none
    assert limiter("execution_count", "R1:2,G:1") is not None
    with pytest.raises(InvalidConfig, match="needs 2 of rate limiter resource 'R1' on device 0"):
        limiter("execution_count", "R1:1")
    with pytest.raises(InvalidConfig, match="needs 2 of rate limiter resource 'R1'"):
        limiter("execution_count", "R1:5,R1:1:0")


def _limiter(redis: Redis, namespace: str, needs: dict[str, tuple[int, int | None]]) -> RateLimiter:
    keys = Keys(namespace)
    wanted = [
        rate_limiter._Need(keys.rate_limit_resource(name, "host", 0), count, given)
        for name, (count, given) in needs.items()
    ]
    return RateLimiter(redis, uuid.uuid4().hex, wanted, 0)


async def _holds(limiter: RateLimiter, entered: asyncio.Event, leave: asyncio.Event) -> None:
    async with limiter.holding():
        entered.set()
        await leave.wait()
    await limiter.settled()


async def test_an_instance_waits_while_others_hold_what_it_needs(redis: Redis) -> None:
    namespace = uuid.uuid4().hex
    # R has as many copies as the most any instance needs (2): two instances needing 1 each
    # run together, a third waits; with R given as 1, the second waits too.
    big = _limiter(redis, namespace, {"R": (2, None)})
    small = [_limiter(redis, namespace, {"R": (1, None)}) for _ in range(3)]
    await big._take("register-only")  # (registers what it needs: the default count is 2)
    await big._release("register-only")
    entered = [asyncio.Event() for _ in small]
    leave = asyncio.Event()
    tasks = [asyncio.create_task(_holds(s, e, leave)) for s, e in zip(small, entered, strict=True)]

    def inside() -> int:
        return sum(event.is_set() for event in entered)

    try:
        deadline = asyncio.get_running_loop().time() + 5
        while inside() < 2:  # (any two of the three: they ask at once)
            assert asyncio.get_running_loop().time() < deadline, "two never held R together"
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)
        assert inside() == 2
        leave.set()
        await asyncio.wait_for(asyncio.gather(*tasks), 5)
        assert inside() == 3
    finally:
        leave.set()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def test_all_resources_are_taken_at_once_or_none(redis: Redis) -> None:
    namespace = uuid.uuid4().hex
    both = _limiter(redis, namespace, {"A": (1, 1), "B": (1, 1)})
    only_b = _limiter(redis, namespace, {"B": (1, 1)})
    only_a = _limiter(redis, namespace, {"A": (1, 1)})
    leave_b, entered_b = asyncio.Event(), asyncio.Event()
    entered_both, leave_both = asyncio.Event(), asyncio.Event()
    holder = asyncio.create_task(_holds(only_b, entered_b, leave_b))
    waiter: asyncio.Task[None] | None = None
    try:
        await asyncio.wait_for(entered_b.wait(), 5)
        waiter = asyncio.create_task(_holds(both, entered_both, leave_both))
        await asyncio.sleep(0.2)
        assert not entered_both.is_set()
        # The waiter holds nothing meanwhile: A is free for another.
        entered_a, leave_a = asyncio.Event(), asyncio.Event()
        leave_a.set()
        await asyncio.wait_for(_holds(only_a, entered_a, leave_a), 5)
        leave_b.set()
        await asyncio.wait_for(entered_both.wait(), 5)
        leave_both.set()
        await asyncio.gather(holder, waiter)
    finally:
        leave_b.set()
        leave_both.set()
        tasks = [task for task in (holder, waiter) if task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def test_a_holder_that_died_gives_its_resources_back_when_its_hold_runs_out(
    redis: Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(rate_limiter, "HOLD_S", 0.3)
    namespace = uuid.uuid4().hex
    dead = _limiter(redis, namespace, {"R": (1, 1)})
    await dead._take("never-released")  # (its worker was killed while computing)
    alive = _limiter(redis, namespace, {"R": (1, 1)})
    entered, leave = asyncio.Event(), asyncio.Event()
    leave.set()
    started = asyncio.get_running_loop().time()
    await asyncio.wait_for(_holds(alive, entered, leave), 5)
    assert asyncio.get_running_loop().time() - started >= 0.2
