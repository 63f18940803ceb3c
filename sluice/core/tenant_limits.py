"""Per-tenant limits and shares, as an operator writes them (TOML), and their checks.

One ``[default]`` table (every tenant not named; without it: no limits, weight 1) and one
``[tenants.<name>]`` table per named tenant, each with these optional fields:

- ``weight``: the tenant's share of a model's queue (and of the workers' turns within a
  priority level), relative to the other tenants' weights; default 1.
- ``rate`` (requests/s) and ``burst`` (requests, default ``max(1, rate)``): a token bucket.
- ``max_in_flight``: the tenant's requests held at once.
- ``max_queued_bytes``: bytes of the tenant's requests waiting or computing.

Everything wrong is a :class:`TenantLimitsError` naming the table and the field; a tenant
that no configured key belongs to is one too, so a typo cannot leave a tenant unlimited.
"""

from __future__ import annotations

import math
import tomllib
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

from sluice.core.tenants import is_tenant_name

WILDCARD = "*"
"""The field of the weights hash that stands for every tenant not named."""

LIMIT_NAMES = ("rate", "in_flight", "queued_bytes")
"""The limits a refusal names (``QuotaExceeded``'s message, the metrics' ``limit`` label)."""


class TenantLimitsError(ValueError):
    """The limits cannot be used; the message names the entry and the field."""


@dataclass(frozen=True, slots=True)
class TenantLimit:
    """One tenant's share and limits (None: no such limit)."""

    weight: float = 1.0
    rate: float | None = None
    """Requests per second, refilled continuously."""
    burst: float | None = None
    """Bucket size: requests that may come at once after a quiet spell (set with ``rate``)."""
    max_in_flight: int | None = None
    max_queued_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.rate is not None and self.burst is None:
            object.__setattr__(self, "burst", max(1.0, self.rate))

    @property
    def limited(self) -> bool:
        """Whether any request of the tenant has something to check."""
        return (
            self.rate is not None
            or self.max_in_flight is not None
            or self.max_queued_bytes is not None
        )

    def gauges(self) -> dict[str, float]:
        """The limits set, by the name the ``sluice_tenant_limit`` gauge gives them."""
        values: dict[str, float] = {"weight": self.weight}
        if self.rate is not None and self.burst is not None:
            values["rate"] = self.rate
            values["burst"] = self.burst
        if self.max_in_flight is not None:
            values["in_flight"] = self.max_in_flight
        if self.max_queued_bytes is not None:
            values["queued_bytes"] = self.max_queued_bytes
        return values


NO_LIMIT = TenantLimit()


@dataclass(frozen=True, slots=True)
class TenantLimits:
    """The limits in force: per named tenant, and the default for every other one."""

    tenants: Mapping[str, TenantLimit] = field(default_factory=dict)
    default: TenantLimit = NO_LIMIT

    def of(self, tenant: str) -> TenantLimit:
        return self.tenants.get(tenant, self.default)

    def weight(self, tenant: str) -> float:
        return self.of(tenant).weight

    def weights(self) -> dict[str, str]:
        """The weights hash the workers read: tenant -> weight, ``*`` for the others."""
        weights = {WILDCARD: _number_text(self.default.weight)}
        weights.update({name: _number_text(limit.weight) for name, limit in self.tenants.items()})
        return weights


_FIELDS = ("weight", "rate", "burst", "max_in_flight", "max_queued_bytes")


def parse_tenant_limits(text: str, source: str, tenants: Collection[str]) -> TenantLimits:
    """The limits of a TOML document; ``source`` names it in errors (the file, or the
    setting), ``tenants``: the tenants that exist (those of the configured keys, or
    ``anonymous`` alone without keys)."""
    try:
        document = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise TenantLimitsError(f"{source}: not valid TOML: {exc}") from None
    unknown = sorted(set(document) - {"default", "tenants"})
    if unknown:
        raise TenantLimitsError(
            f"{source}: unknown table or key {unknown[0]!r} (expected [default] and "
            "[tenants.<name>])"
        )
    default = NO_LIMIT
    if "default" in document:
        default = _limit(document["default"], f"{source}: [default]")
    named = document.get("tenants", {})
    if not isinstance(named, dict):
        raise TenantLimitsError(f"{source}: 'tenants' must be tables [tenants.<name>]")
    limits: dict[str, TenantLimit] = {}
    for name, table in named.items():
        where = f"{source}: [tenants.{name}]"
        if not is_tenant_name(name):
            raise TenantLimitsError(
                f"{where}: {name[:64]!r} is not a tenant name (1 to 64 letters, digits, "
                "'_', '.', '-', starting with a letter or digit)"
            )
        if name not in tenants:
            raise TenantLimitsError(
                f"{where}: unknown tenant {name!r}: no API key belongs to it "
                f"(known: {', '.join(sorted(tenants)[:20]) or 'none'})"
            )
        limits[name] = _limit(table, where)
    return TenantLimits(limits, default)


def _limit(table: Any, where: str) -> TenantLimit:
    if not isinstance(table, dict):
        raise TenantLimitsError(f"{where}: must be a table of limits, got {_shown(table)}")
    unknown = [key for key in table if key not in _FIELDS]
    if unknown:
        raise TenantLimitsError(
            f"{where} {unknown[0]}: unknown field (expected {', '.join(_FIELDS)})"
        )
    weight = _number(table, "weight", where, minimum=0.0, least=MIN_WEIGHT, most=MAX_WEIGHT)
    rate = _number(table, "rate", where, minimum=0.0, least=MIN_RATE, most=MAX_NUMBER)
    burst = _number(table, "burst", where, minimum=1.0, inclusive=True, most=MAX_NUMBER)
    if burst is not None and rate is None:
        raise TenantLimitsError(f"{where} burst: needs a rate (requests/s) to refill it")
    return TenantLimit(
        weight=1.0 if weight is None else weight,
        rate=rate,
        burst=burst,
        max_in_flight=_whole(table, "max_in_flight", where),
        max_queued_bytes=_whole(table, "max_queued_bytes", where),
    )


MIN_WEIGHT, MAX_WEIGHT = 1e-6, 1e6
"""Weights are relative: a trillion to one is as far apart as shares go (the workers divide
by them, and add them up)."""
MIN_RATE = 1e-6
"""Requests per second: one every eleven days and a half at the least (a rate that rounds
to nothing would make the time to the next token infinite)."""
MAX_NUMBER = 1e12
"""Rates and bursts beyond this are no limit, and a typo."""
MAX_WHOLE = (1 << 63) - 1
"""Requests in flight and queued bytes: what 64 bits hold (TOML's own integers; an integer
past a float's range would fail every ``/metrics``)."""


def _number(
    table: dict[str, Any],
    name: str,
    where: str,
    *,
    minimum: float,
    inclusive: bool = False,
    least: float = 0.0,
    most: float,
) -> float | None:
    """The field ``name``: a number above ``minimum`` (or equal, ``inclusive``), from
    ``least`` to ``most``."""
    if name not in table:
        return None
    value = table[name]
    bound = f">= {minimum:g}" if inclusive else f"> {minimum:g}"
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or (isinstance(value, float) and not math.isfinite(value))
        or value < minimum
        or (value == minimum and not inclusive)
    ):
        raise TenantLimitsError(f"{where} {name}: must be a number {bound}, got {_shown(value)}")
    if value < least:
        raise TenantLimitsError(f"{where} {name}: must be at least {least:g}, got {value:g}")
    if value > most:  # (an integer too large for a float compares without converting)
        raise TenantLimitsError(f"{where} {name}: must be at most {most:g}, got {_shown(value)}")
    return float(value)


def _whole(table: dict[str, Any], name: str, where: str) -> int | None:
    if name not in table:
        return None
    value = table[name]
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise TenantLimitsError(f"{where} {name}: must be a whole number >= 1, got {_shown(value)}")
    if value > MAX_WHOLE:
        raise TenantLimitsError(f"{where} {name}: must be at most {MAX_WHOLE}, got {_shown(value)}")
    return value


def _shown(value: Any) -> str:
    """``value`` as an error shows it: no more than 64 characters of it."""
    text = repr(value)
    return text if len(text) <= 64 else f"{text[:61]}..."


def _number_text(value: float) -> str:
    return str(int(value)) if value.is_integer() else repr(value)
