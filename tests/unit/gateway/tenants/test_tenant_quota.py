"""Each tenant's limits in one gateway process (sluice.gateway.tenants.quota), on a fake clock."""

from __future__ import annotations

import pytest

from sluice.core.errors import PayloadTooLarge, QuotaExceeded
from sluice.core.tenant_limits import TenantLimit, TenantLimits
from sluice.gateway.inference.request import InputTensor
from sluice.gateway.tenants.quota import PeerUsage, TenantQuota, TokenBucket

TENANTS = ("team-a", "team-b")


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def tensor(nbytes: int) -> InputTensor:
    return InputTensor("IN", "UINT8", (nbytes,), b"\0" * nbytes)


def quota(clock: FakeClock, **limits: TenantLimit) -> TenantQuota:
    return TenantQuota(TENANTS, clock, TenantLimits(limits))


def refusal(q: TenantQuota, tenant: str, nbytes: int = 0) -> QuotaExceeded:
    with pytest.raises(QuotaExceeded) as caught, q.hold(tenant, [tensor(nbytes)]):
        pass
    return caught.value


def test_token_bucket_refills_at_its_rate_up_to_its_size() -> None:
    bucket = TokenBucket(rate=2.0, burst=3.0, now=0.0)
    assert [bucket.take(0.0) for _ in range(3)] == [0.0, 0.0, 0.0]
    assert bucket.take(0.0) == pytest.approx(0.5)  # one token every 0.5 s
    assert bucket.take(0.25) == pytest.approx(0.25)
    assert bucket.take(0.5) == 0.0
    assert [bucket.take(100.0) for _ in range(3)] == [0.0, 0.0, 0.0]  # no more than burst
    assert bucket.take(100.0) > 0


def test_rate_refusal_names_tenant_and_limit_with_the_time_to_a_token() -> None:
    clock = FakeClock()
    q = quota(clock, **{"team-a": TenantLimit(rate=0.25, burst=2.0)})
    for _ in range(2):
        with q.hold("team-a", []):
            pass
    error = refusal(q, "team-a")
    assert error.status == 429 and error.grpc_code == "RESOURCE_EXHAUSTED"
    assert error.message == (
        "tenant 'team-a' is over its rate limit (rate=0.25/s, burst=2); retry later"
    )
    assert error.retry_after_s == 4
    with q.hold("team-b", []):  # another tenant does not notice
        pass
    clock.now += 4.0
    with q.hold("team-a", []):
        pass
    assert q.take_counts()[0] == {("team-a", "rate"): 1}


def test_a_tenant_without_limits_is_not_tracked() -> None:
    q = quota(FakeClock(), **{"team-a": TenantLimit(weight=5.0)})
    assert q.usage == {}
    for _ in range(1000):
        with q.hold("team-a", []):
            pass


def test_in_flight_counts_this_process_and_the_others() -> None:
    q = quota(FakeClock(), **{"team-a": TenantLimit(max_in_flight=3)})
    first, second = q.hold("team-a", []), q.hold("team-a", [])
    with first, second:
        assert q.own_usage() == {"team-a": (2, 0)}
        q.observe_peers({"team-a": PeerUsage(in_flight=1)})
        error = refusal(q, "team-a")
        assert error.message == (
            "tenant 'team-a' is over its in_flight limit (max_in_flight=3); retry later"
        )
        assert error.retry_after_s == 1
        q.observe_peers({})
        with q.hold("team-a", []):
            pass
    assert q.own_usage() == {"team-a": (0, 0)}


def test_queued_bytes_are_released_when_the_answer_comes() -> None:
    q = quota(FakeClock(), **{"team-a": TenantLimit(max_queued_bytes=100)})
    with q.hold("team-a", [tensor(60), tensor(20)]):
        assert q.own_usage()["team-a"] == (1, 80)
        assert "over its queued_bytes limit (max_queued_bytes=100)" in (
            refusal(q, "team-a", 30).message
        )
        with q.hold("team-a", [tensor(20)]):
            pass
    with (
        pytest.raises(PayloadTooLarge, match="queued_bytes limit"),
        q.hold("team-a", [tensor(101)]),
    ):
        pass
    assert q.own_usage()["team-a"] == (0, 0)
    with pytest.raises(RuntimeError), q.hold("team-a", [tensor(50)]):
        raise RuntimeError("failed: released all the same")
    assert q.own_usage()["team-a"] == (0, 0)


def test_without_demands_each_process_refills_an_equal_share() -> None:
    clock = FakeClock()
    q = quota(clock, **{"team-a": TenantLimit(rate=10.0, burst=10.0)})
    q.set_processes(5)
    bucket = q.usage["team-a"].bucket
    assert bucket is not None and (bucket.rate, bucket.burst) == (2.0, 2.0)
    q.set_processes(0)  # (never below one)
    assert (bucket.rate, bucket.burst) == (10.0, 10.0)


def ask(q: TenantQuota, clock: FakeClock, tenant: str, per_s: int, seconds: float) -> int:
    """``per_s`` requests a second for ``seconds``, evenly spaced; how many were admitted."""
    admitted = 0
    for _ in range(int(per_s * seconds)):
        clock.now += 1 / per_s
        try:
            with q.hold(tenant, []):
                admitted += 1
        except QuotaExceeded:
            pass
    return admitted


def test_a_process_that_all_the_requests_reach_gets_the_whole_rate() -> None:
    """Two processes, the tenant's every request on this one (one gRPC channel): after one
    report of the demands, this process admits the whole rate, the other a trickle."""
    clock = FakeClock()
    here = quota(clock, **{"team-a": TenantLimit(rate=100.0, burst=10.0)})
    there = quota(clock, **{"team-a": TenantLimit(rate=100.0, burst=10.0)})
    for q in (here, there):
        q.set_processes(2)
        q.measure_demand()
    assert ask(here, clock, "team-a", 80, 0.5) < 60  # half the rate before any report
    for _ in range(3):  # (three refreshes: the smoothed demand settles)
        ask(here, clock, "team-a", 80, 0.5)
        here_demand, there_demand = here.measure_demand(), there.measure_demand()
        here.observe_peers({"team-a": PeerUsage(demand=there_demand["team-a"])})
        there.observe_peers({"team-a": PeerUsage(demand=here_demand["team-a"])})
    assert ask(here, clock, "team-a", 80, 2.0) == 160  # under its rate: all admitted
    bucket = there.usage["team-a"].bucket
    assert bucket is not None and bucket.rate < 20


def asked_here(limit: TenantLimit, processes: int, per_s: int) -> tuple[TenantQuota, TokenBucket]:
    """A process of ``processes`` whose measured demand for team-a is ``per_s`` a second,
    and team-a's bucket there."""
    clock = FakeClock()
    q = quota(clock, **{"team-a": limit})
    q.set_processes(processes)
    q.measure_demand()
    ask(q, clock, "team-a", per_s, 1.0)
    assert q.measure_demand()["team-a"] == pytest.approx(per_s)
    bucket = q.usage["team-a"].bucket
    assert bucket is not None
    return q, bucket


def test_over_the_rate_the_processes_share_it_by_their_demands() -> None:
    q, bucket = asked_here(TenantLimit(rate=100.0, burst=1.0), 2, 150)
    q.observe_peers({"team-a": PeerUsage(demand=50.0)})
    assert bucket.rate == pytest.approx(75.0)  # 100 * 150 / 200
    q.observe_peers({"team-a": PeerUsage(demand=10.0)})
    assert bucket.rate == pytest.approx(93.75)  # still over together: 100 * 150 / 160
    q.observe_peers({"team-a": PeerUsage(demand=1000.0)})
    assert bucket.rate == pytest.approx(100.0 * 150 / 1150)


def test_the_slack_under_the_rate_is_shared_equally() -> None:
    q, bucket = asked_here(TenantLimit(rate=100.0, burst=10.0), 4, 30)
    q.observe_peers({"team-a": PeerUsage(demand=30.0)})
    assert bucket.rate == pytest.approx(30.0 + 40.0 / 4)
    assert bucket.burst == pytest.approx(4.0)  # 10 * 40 / 100


def test_refusals_count_as_demand() -> None:
    """A process whose share is small refuses, and the refused requests raise its demand:
    its share follows the traffic that reaches it."""
    clock = FakeClock()
    q = quota(clock, **{"team-a": TenantLimit(rate=10.0, burst=1.0)})
    q.set_processes(2)
    q.measure_demand()
    q.observe_peers({"team-a": PeerUsage(demand=1000.0)})  # the other took it all
    admitted = ask(q, clock, "team-a", 40, 1.0)
    assert admitted <= 2
    assert q.measure_demand()["team-a"] == pytest.approx(40.0)


def test_new_limits_keep_the_usage_and_tokens() -> None:
    clock = FakeClock()
    q = quota(clock, **{"team-a": TenantLimit(rate=1.0, burst=1.0, max_in_flight=5)})
    held = q.hold("team-a", [])
    held.__enter__()
    refusal(q, "team-a")  # the one token is gone
    q.apply(TenantLimits({"team-a": TenantLimit(rate=1.0, burst=5.0, max_in_flight=1)}))
    assert "in_flight" in refusal(q, "team-a").message  # the one held still counts
    held.__exit__(None, None, None)
    assert "rate" in refusal(q, "team-a").message  # no tokens came with the new size
    q.apply(TenantLimits())
    assert q.usage == {}
    with q.hold("team-a", []):
        pass


def test_jobs_take_tokens_and_count_as_admitted() -> None:
    q = quota(FakeClock(), **{"team-a": TenantLimit(rate=1.0)})
    q.check_rate("team-a")
    with pytest.raises(QuotaExceeded, match="over its rate limit"):
        q.check_rate("team-a")
    q.check_rate("team-b")
    rejected, jobs = q.take_counts()
    assert rejected == {("team-a", "rate"): 1}
    assert jobs == {"team-a": 1, "team-b": 1}
    assert q.take_counts() == ({}, {})
