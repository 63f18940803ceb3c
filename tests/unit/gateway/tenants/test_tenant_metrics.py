"""The tenants' counters handed to the shared gateway counters, and their families."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

import pytest
from prometheus_client.parser import text_string_to_metric_families

from sluice.core.errors import QuotaExceeded
from sluice.core.tenant_limits import TenantLimit, TenantLimits
from sluice.gateway.admission import Admission
from sluice.gateway.metrics.snapshot import Snapshot
from sluice.gateway.state import GatewayState
from sluice.gateway.tenants import metrics as tenant_metrics
from sluice.gateway.tenants.limits_source import LimitsSource
from sluice.gateway.tenants.quota import TenantQuota


def state() -> GatewayState:
    limits = TenantLimits({"a": TenantLimit(rate=1.0)})
    return cast(
        GatewayState,
        SimpleNamespace(
            admission=Admission(10),
            quota=TenantQuota(("a", "b"), lambda: 0.0, limits),
            limits_source=LimitsSource(),
        ),
    )


def test_counts_are_taken_and_given_back() -> None:
    s = state()
    with s.admission.admit("m", 1, 0, "", "a"):
        pass
    s.quota.check_rate("a")
    with pytest.raises(QuotaExceeded):
        s.quota.check_rate("a")
    s.limits_source.reload_errors = 2
    fields = tenant_metrics.take_tenant_counts(s)
    assert fields == {
        "tenant.requests:a": 2,
        "tenant.rejected:rate:a": 1,
        "tenant_limits.reload_errors": 2,
    }
    assert tenant_metrics.take_tenant_counts(s) == {}
    tenant_metrics.give_back_tenant_counts(s, {**fields, "tenant.rejected:queue_full:b": 3})
    assert tenant_metrics.take_tenant_counts(s) == {**fields, "tenant.rejected:queue_full:b": 3}


def test_families() -> None:
    counters = {
        "tenant.requests:a": 5,
        "tenant.rejected:rate:a": 2,
        "tenant.rejected:queue_full:b": 1,
        "tenant_limits.reload_errors": 3,
    }
    limits = TenantLimits({"a": TenantLimit(2.0, 10.0, 20.0, 4)}, TenantLimit(weight=1.0))
    text = tenant_metrics.render(Snapshot([], 0, [], counters), limits, ("a", "b")).decode()
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], Any] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    assert samples[("sluice_tenant_requests_total", (("tenant", "a"),))] == 5
    assert samples[("sluice_tenant_rejected_total", (("limit", "rate"), ("tenant", "a")))] == 2
    key = ("sluice_tenant_rejected_total", (("limit", "queue_full"), ("tenant", "b")))
    assert samples[key] == 1
    assert samples[("sluice_tenant_limits_reload_errors_total", ())] == 3
    assert samples[("sluice_tenant_limit", (("limit", "rate"), ("tenant", "a")))] == 10
    assert samples[("sluice_tenant_limit", (("limit", "in_flight"), ("tenant", "a")))] == 4
    assert samples[("sluice_tenant_limit", (("limit", "weight"), ("tenant", "*")))] == 1


def test_tenants_whose_keys_are_gone_have_no_series() -> None:
    """Their counters stay in Redis, but /metrics does not keep a series per tenant that
    ever had a key (rotated bare keys are a new tenant each)."""
    counters = {
        "tenant.requests:a": 5,
        "tenant.requests:key-0123456789abcdef": 7,
        "tenant.rejected:rate:key-0123456789abcdef": 1,
        "tenant.cancelled:gone": 2,
    }
    text = tenant_metrics.render(Snapshot([], 0, [], counters), TenantLimits(), ("a",)).decode()
    tenants = {
        sample.labels["tenant"]
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if "tenant" in sample.labels and family.name != "sluice_tenant_limit"
    }
    assert tenants == {"a"}
