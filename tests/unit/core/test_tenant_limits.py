"""The tenant limits file (sluice.core.tenant_limits): what it reads, and errors that name
the entry and the field."""

from __future__ import annotations

import pytest

from sluice.core.tenant_limits import (
    NO_LIMIT,
    TenantLimit,
    TenantLimitsError,
    parse_tenant_limits,
)

TENANTS = frozenset({"team-a", "team-b", "anonymous"})
SOURCE = "tenant limits file limits.toml"


def parse(text: str):  # type: ignore[no-untyped-def]
    return parse_tenant_limits(text, SOURCE, TENANTS)


def error_of(text: str) -> str:
    with pytest.raises(TenantLimitsError) as caught:
        parse(text)
    return str(caught.value)


def test_a_full_file() -> None:
    limits = parse(
        """
        [default]
        weight = 1
        rate = 10
        [tenants.team-a]
        weight = 3
        rate = 200
        burst = 400
        max_in_flight = 64
        max_queued_bytes = 536870912
        [tenants.team-b]
        weight = 0.5
        """
    )
    assert limits.of("team-a") == TenantLimit(3.0, 200.0, 400.0, 64, 536870912)
    assert limits.of("team-b") == TenantLimit(weight=0.5)
    assert limits.of("anonymous") == TenantLimit(1.0, 10.0, 10.0)
    assert limits.weights() == {"*": "1", "team-a": "3", "team-b": "0.5"}


def test_nothing_means_no_limits_and_weight_one() -> None:
    limits = parse("")
    assert limits.of("team-a") == NO_LIMIT
    assert not NO_LIMIT.limited
    assert limits.weights() == {"*": "1"}


def test_burst_defaults_to_the_rate_and_at_least_one() -> None:
    assert parse("[tenants.team-a]\nrate = 50").of("team-a").burst == 50
    assert parse("[tenants.team-a]\nrate = 0.2").of("team-a").burst == 1


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            '[tenants.team-a]\nrate = "x"',
            "tenant limits file limits.toml: [tenants.team-a] rate: must be a number > 0, got 'x'",
        ),
        ("[tenants.team-a]\nrate = 0", "[tenants.team-a] rate: must be a number > 0, got 0"),
        ("[tenants.team-a]\nrate = -1", "[tenants.team-a] rate: must be a number > 0"),
        ("[tenants.team-a]\nrate = inf", "[tenants.team-a] rate: must be a number > 0"),
        ("[tenants.team-a]\nrate = true", "[tenants.team-a] rate: must be a number > 0"),
        ("[tenants.team-a]\nweight = 0", "[tenants.team-a] weight: must be a number > 0"),
        ("[default]\nweight = nan", "[default] weight: must be a number > 0"),
        (
            "[tenants.team-a]\nrate = 5\nburst = 0.5",
            "[tenants.team-a] burst: must be a number >= 1, got 0.5",
        ),
        ("[tenants.team-a]\nburst = 5", "[tenants.team-a] burst: needs a rate"),
        (
            "[tenants.team-a]\nmax_in_flight = 1.5",
            "[tenants.team-a] max_in_flight: must be a whole number >= 1, got 1.5",
        ),
        (
            "[tenants.team-a]\nmax_in_flight = 0",
            "[tenants.team-a] max_in_flight: must be a whole number >= 1, got 0",
        ),
        (
            "[tenants.team-b]\nmax_queued_bytes = '1GB'",
            "[tenants.team-b] max_queued_bytes: must be a whole number >= 1, got '1GB'",
        ),
        ("[tenants.team-a]\nrte = 5", "[tenants.team-a] rte: unknown field"),
        ("[default]\nmax_inflight = 5", "[default] max_inflight: unknown field"),
        ("[defaults]\nweight = 2", "unknown table or key 'defaults'"),
        ("weight = 2", "unknown table or key 'weight'"),
        ("tenants = 3", "'tenants' must be tables"),
        ("[tenants]\nteam-a = 3", "[tenants.team-a]: must be a table of limits, got 3"),
        ("[tenants.team-c]\nweight = 2", "[tenants.team-c]: unknown tenant 'team-c'"),
        ('[tenants."bad name"]\nweight = 2', "'bad name' is not a tenant name"),
        ("[tenants.team-a\nweight = 2", "tenant limits file limits.toml: not valid TOML"),
        # Numbers past what a float (or Redis) holds, or so small that nothing is left
        ("[tenants.team-a]\nrate = 1" + "0" * 400, "[tenants.team-a] rate: must be at most 1e+12"),
        ("[tenants.team-a]\nrate = 1e300", "[tenants.team-a] rate: must be at most 1e+12"),
        ("[tenants.team-a]\nrate = 5e-324", "[tenants.team-a] rate: must be at least 1e-06"),
        ("[tenants.team-a]\nweight = 1e-300", "[tenants.team-a] weight: must be at least 1e-06"),
        ("[default]\nweight = 1e300", "[default] weight: must be at most 1e+06"),
        (
            "[tenants.team-a]\nrate = 5\nburst = 1" + "0" * 400,
            "[tenants.team-a] burst: must be at most 1e+12, got 1000000000",
        ),
        (
            "[tenants.team-a]\nmax_in_flight = 1" + "0" * 400,
            "[tenants.team-a] max_in_flight: must be at most 9223372036854775807",
        ),
        (
            "[tenants.team-b]\nmax_queued_bytes = 9223372036854775808",
            "[tenants.team-b] max_queued_bytes: must be at most 9223372036854775807",
        ),
        ("[tenants.team-a]\nrate = '" + "x" * 10_000 + "'", "got 'xxxxxxxx"),
    ],
)
def test_errors_name_the_entry_and_field(text: str, expected: str) -> None:
    assert expected in error_of(text)


def test_without_keys_only_anonymous_exists() -> None:
    only_anonymous = frozenset({"anonymous"})
    limits = parse_tenant_limits("[tenants.anonymous]\nrate = 5", SOURCE, only_anonymous)
    assert limits.of("anonymous").rate == 5
    with pytest.raises(TenantLimitsError, match=r"unknown tenant 'team-a'"):
        parse_tenant_limits("[tenants.team-a]\nrate = 5", SOURCE, only_anonymous)


def test_gauges_name_the_limits_set() -> None:
    limit = TenantLimit(2.0, 5.0, 8.0, None, 100)
    assert limit.gauges() == {"weight": 2.0, "rate": 5.0, "burst": 8.0, "queued_bytes": 100}


def test_an_error_shows_no_more_than_the_start_of_a_value() -> None:
    assert len(error_of("[tenants.team-a]\nrate = '" + "x" * 10_000 + "'")) < 200
