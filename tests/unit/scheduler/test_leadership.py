"""The controller lease against a real redis-server: one leader at a time, renewals,
expiry, release, and fencing tokens that refuse a former leader's writes."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator

import pytest
from redis import Redis

from sluice.core.keys import Keys
from sluice.core.settings import ControllerSettings
from sluice.scheduler.controller.leadership import Lease, Write, apply_fenced
from sluice.scheduler.controller.leading import run_controller
from sluice.scheduler.executor.redis_server import RedisServer
from tests.support import procs


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def redis(redis_server: RedisServer) -> Iterator[Redis]:
    client = Redis.from_url(redis_server.url)
    yield client
    client.close()


@pytest.fixture
def keys() -> Keys:
    return Keys(f"t{uuid.uuid4().hex[:8]}")


def test_the_first_to_ask_leads_with_token_1(redis: Redis, keys: Keys) -> None:
    lease = Lease(redis, keys, "a")
    claim = lease.acquire()
    assert (claim.holder, claim.token) == ("a", 1)
    assert lease.is_leader and lease.token == 1
    assert redis.get(keys.controller_lease) == b"a"
    assert redis.get(keys.controller_fencing) == b"1"
    assert 2900 < redis.pttl(keys.controller_lease) <= 3000


def test_only_one_of_many_contenders_leads(redis: Redis, keys: Keys) -> None:
    leases = [Lease(redis, keys, f"c{i}") for i in range(8)]
    start = threading.Barrier(len(leases))
    claims = {}

    def contend(lease: Lease) -> None:
        start.wait()
        claims[lease.holder] = lease.acquire()

    threads = [threading.Thread(target=contend, args=(lease,)) for lease in leases]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    leaders = [lease for lease in leases if lease.is_leader]
    assert len(leaders) == 1
    winner = leaders[0].holder
    assert claims[winner].token == 1
    for holder, claim in claims.items():
        if holder != winner:
            assert claim.token is None and claim.holder == winner
            assert 0 < claim.expires_in_s <= 3.0


@pytest.mark.slow
def test_renewals_keep_the_lease_past_its_ttl(redis: Redis, keys: Keys) -> None:
    clock = FakeClock()
    lease = Lease(redis, keys, "a", ttl_s=0.6, clock=clock)
    other = Lease(redis, keys, "b", ttl_s=0.6)
    lease.acquire()
    for _ in range(4):  # 1.2 s in all, twice the ttl
        time.sleep(0.3)
        clock.now += 0.3
        assert lease.renew()
        assert lease.is_leader
    assert other.acquire().token is None
    assert redis.pttl(keys.controller_lease) > 400


def test_without_renewals_the_lease_expires_and_another_takes_over(
    redis: Redis, keys: Keys
) -> None:
    clock = FakeClock()
    old = Lease(redis, keys, "a", ttl_s=0.3, clock=clock)
    new = Lease(redis, keys, "b", ttl_s=0.3)
    assert old.acquire().token == 1
    clock.now += 0.3 - old.margin_s  # locally, ttl minus the margin has gone by
    assert not old.is_leader and old.token is None  # before Redis even expires it
    time.sleep(0.35)
    assert new.acquire().token == 2
    assert not old.renew()
    assert redis.get(keys.controller_lease) == b"b"


def test_a_refused_renewal_ends_leadership_at_once(redis: Redis, keys: Keys) -> None:
    lease = Lease(redis, keys, "a")
    lease.acquire()
    redis.set(keys.controller_lease, "b")  # as if it had expired and b had taken it
    assert not lease.renew()
    assert not lease.is_leader
    assert redis.get(keys.controller_lease) == b"b"


def test_release_frees_the_lease_for_a_standby_at_once(redis: Redis, keys: Keys) -> None:
    a = Lease(redis, keys, "a")
    b = Lease(redis, keys, "b")
    a.acquire()
    assert b.acquire().token is None
    a.release()
    assert not a.is_leader
    assert redis.get(keys.controller_lease) is None
    assert b.acquire().token == 2


def test_release_by_a_former_leader_leaves_the_new_lease_alone(redis: Redis, keys: Keys) -> None:
    clock = FakeClock()
    a = Lease(redis, keys, "a", ttl_s=0.2, clock=clock)
    b = Lease(redis, keys, "b")
    a.acquire()
    time.sleep(0.25)
    b.acquire()
    a.release()
    assert redis.get(keys.controller_lease) == b"b"
    assert b.renew()


def test_an_old_token_cannot_apply_after_a_new_leader_acquired(redis: Redis, keys: Keys) -> None:
    """A paused leader wakes after its lease expired and another took over: its write,
    already on its way, is refused; the new leader's goes through."""
    decisions = keys.controller_decisions
    clock = FakeClock()  # the old leader's clock stands still: it still believes it leads
    old = Lease(redis, keys, "a", ttl_s=0.2, clock=clock)
    new = Lease(redis, keys, "b")
    assert old.acquire().token == 1
    assert old.apply([Write("RPUSH", decisions, ("1:1",))])
    time.sleep(0.25)
    assert new.acquire().token == 2
    assert old.is_leader  # by its own (stopped) clock
    assert not old.apply([Write("RPUSH", decisions, ("1:2",))])
    assert not old.is_leader  # the refusal ended its leadership
    assert not apply_fenced(redis, keys, "a", 1, [Write("RPUSH", decisions, ("1:3",))])
    assert new.apply([Write("RPUSH", decisions, ("2:1",))])
    assert redis.lrange(decisions, 0, -1) == [b"1:1", b"2:1"]


def test_taking_back_ones_own_lease_gives_a_new_token_and_fences_the_old_one(
    redis: Redis, keys: Keys
) -> None:
    lease = Lease(redis, keys, "a")
    assert lease.acquire().token == 1
    assert lease.acquire().token == 2  # e.g. after a local timeout while Redis kept it
    assert not apply_fenced(redis, keys, "a", 1, [Write("SET", keys.controller_decisions, ("x",))])
    assert redis.exists(keys.controller_decisions) == 0


def test_a_fenced_decision_applies_all_its_writes(redis: Redis, keys: Keys) -> None:
    lease = Lease(redis, keys, "a")
    lease.acquire()
    target = f"{keys.namespace}:target"
    assert lease.apply(
        [
            Write("HSET", target, ("m1", "loaded", "m2", 3)),
            Write("EXPIRE", target, (60,)),
            Write("RPUSH", keys.controller_decisions, (b"\x00bytes",)),
        ]
    )
    assert redis.hgetall(target) == {b"m1": b"loaded", b"m2": b"3"}
    assert 0 < redis.ttl(target) <= 60
    assert redis.lrange(keys.controller_decisions, 0, -1) == [b"\x00bytes"]


def test_tokens_only_grow(redis: Redis, keys: Keys) -> None:
    leases = [Lease(redis, keys, holder) for holder in "abc"]
    tokens = []
    for round_ in range(3):
        for lease in leases:
            claim = lease.acquire()
            assert claim.token is not None, round_
            tokens.append(claim.token)
            lease.release()
    assert tokens == sorted(tokens) and len(set(tokens)) == len(tokens)


def test_the_margin_must_be_below_the_ttl(redis: Redis, keys: Keys) -> None:
    with pytest.raises(ValueError, match="margin"):
        Lease(redis, keys, "a", ttl_s=1.0, margin_s=1.0)


@pytest.mark.slow
def test_a_controller_that_stops_hands_over_to_the_standby_at_once(
    redis_server: RedisServer, redis: Redis, keys: Keys
) -> None:
    ticks: dict[str, list[int]] = {"a": [], "b": []}
    stops = {name: threading.Event() for name in ticks}

    def start(name: str) -> threading.Thread:
        settings = ControllerSettings(
            redis_url=redis_server.url, namespace=keys.namespace, controller_id=name
        )

        def tick(lease: Lease) -> None:
            assert lease.token is not None
            ticks[name].append(lease.token)

        thread = threading.Thread(
            target=run_controller,
            args=(settings, stops[name], lambda lease: None, tick),
            kwargs={"tick_s": 0.05},
        )
        thread.start()
        return thread

    a = start("a")
    try:
        assert procs.wait_until(lambda: bool(ticks["a"]), 5, 0.01)
        b = start("b")
        try:
            time.sleep(0.3)
            assert ticks["b"] == []  # a standby does not tick
            stops["a"].set()
            stopped_at = time.monotonic()
            a.join(5)
            assert procs.wait_until(lambda: bool(ticks["b"]), 5, 0.01)
            assert time.monotonic() - stopped_at < 1.5  # the released lease, not its expiry
            assert set(ticks["a"]) == {1} and set(ticks["b"]) == {2}
        finally:
            stops["b"].set()
            b.join(5)
    finally:
        stops["a"].set()
        a.join(5)
    assert redis.get(keys.controller_lease) is None
