"""Which catalog revision each live gateway process has applied, as its report says.

Every refresh, a gateway process reads the catalog revision (``Keys.catalog_revision``),
reloads the catalog when it moved, then writes its report (``Keys.gateway_report``) with
the revision its view now holds (:data:`APPLIED_REVISION`). An executor that took a model,
or some of its versions, out of the catalog waits until every live gateway reports the
revision of that change (or a later one) before it judges the model's streams empty:
until then a gateway may still admit a request for what was taken away
(:mod:`sluice.scheduler.executor.model_control`).

A revision is a decimal integer that only grows and is never given twice, even when its
key alone was lost (it starts again from Redis's clock in microseconds): a gateway is
caught up once the number it reports is at least the one to wait for.
"""

from __future__ import annotations

from typing import cast

from redis import Redis

from sluice.core.clock import CLOCK
from sluice.core.keys import Keys

REPORT_TTL_S = 5
"""A gateway's report, and its place among the live gateways (``Keys.gateways``), outlive
its last refresh by this much; a gateway refreshes at least every 4 s
(``SLUICE_CATALOG_IDLE_REFRESH_S``), so a live one always has a report."""

APPLIED_REVISION = "catalog_revision"
"""Field of a gateway's report: the catalog revision its view holds (absent until it has
read a catalog)."""

CATCH_UP_S = 2 * REPORT_TTL_S
"""The most an executor waits for the live gateways to report a revision. A live gateway
reports again within its idle refresh, and one that stopped refreshing leaves the live
ones within :data:`REPORT_TTL_S`; this bound is for what should not happen (a gateway that
keeps reporting without applying the catalog, clocks far apart)."""


def revision_number(raw: bytes | str | int | None) -> int | None:
    """A revision as written in Redis (decimal digits), None for none or a malformed one."""
    if raw is None:
        return None
    if isinstance(raw, int):
        return raw
    text = raw.decode("ascii", errors="replace") if isinstance(raw, bytes) else raw
    if not (text.isascii() and text.isdigit()) or len(text) > 20:
        return None
    return int(text)


def published_revision(client: Redis, keys: Keys) -> int | None:
    """The catalog revision in Redis now (None: no catalog is published)."""
    return revision_number(cast(bytes | None, client.get(keys.catalog_revision)))


def lagging_gateways(client: Redis, keys: Keys, revision: int) -> list[str]:
    """The live gateway processes whose report shows no catalog revision, or one older
    than ``revision``. A gateway whose report expired is not live, whatever the sorted set
    of gateways still says."""
    CLOCK.sync_blocking(client)  # (the gateways' expiries are on the deployment's clock)
    members = client.zrangebyscore(keys.gateways, CLOCK.now(), "+inf")
    gateways = [m.decode() if isinstance(m, bytes) else str(m) for m in members]
    if not gateways:
        return []
    # (every gateway key is in the namespace's slot: one pipeline, also on a cluster)
    with client.pipeline(transaction=False) as pipe:
        for gateway in gateways:
            report = keys.gateway_report(gateway)
            pipe.exists(report)
            pipe.hget(report, APPLIED_REVISION)
        results = pipe.execute()
    lagging = []
    for index, gateway in enumerate(gateways):
        exists, applied = results[2 * index], results[2 * index + 1]
        if not exists:
            continue
        number = revision_number(applied)
        if number is None or number < revision:
            lagging.append(gateway)
    return lagging
