"""Each tenant's limits in one gateway process (sluice.gateway.tenant_quota), on a fake clock."""

from __future__ import annotations

import pytest

from sluice.core.errors import PayloadTooLarge, QuotaExceeded
from sluice.core.tenant_limits import TenantLimit, TenantLimits
from sluice.gateway.infer_request import InputTensor
from sluice.gateway.tenant_quota import TenantQuota, TokenBucket

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
        q.observe_peers({"team-a": (1, 0)})
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


def test_each_process_refills_its_share_of_the_rate() -> None:
    clock = FakeClock()
    q = quota(clock, **{"team-a": TenantLimit(rate=10.0, burst=10.0)})
    q.set_processes(5)
    bucket = q.usage["team-a"].bucket
    assert bucket is not None and (bucket.rate, bucket.burst) == (2.0, 2.0)
    q.set_processes(0)  # (never below one)
    assert (bucket.rate, bucket.burst) == (10.0, 10.0)


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
