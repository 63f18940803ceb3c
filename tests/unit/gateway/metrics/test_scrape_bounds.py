"""``/metrics`` (and the statistics extension) against what it reads and who asks: values
in Redis that are not Sluice's counters fail no scrape, scrapes that arrive together read
Redis once, and what the process keeps between scrapes stays bounded however often they
come."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from types import SimpleNamespace
from typing import Any, cast

import httpx
import pytest
from fastapi import FastAPI
from prometheus_client.parser import text_string_to_metric_families
from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError

from sluice.core.catalog import CatalogEntry
from sluice.core.config.parse import parse_config_text
from sluice.core.keys import Keys
from sluice.core.observability import statistics as st
from sluice.core.settings import GatewaySettings
from sluice.core.tenant_limits import TenantLimits
from sluice.gateway.control.catalog_view import CatalogView
from sluice.gateway.metrics import exposition, sluice_families, snapshot
from sluice.gateway.metrics.port import MetricsOnly
from sluice.gateway.metrics.snapshot import Snapshot, StreamState, VersionState
from sluice.gateway.state import GatewayState

CONFIG = 'name: "m"\nbackend: "python"\nmax_batch_size: 0\n'


def families(text: bytes) -> dict[str, list[Any]]:
    """Samples by family, as Prometheus parses them (an error where it would refuse it)."""
    return {family.name: family.samples for family in text_string_to_metric_families(text.decode())}


async def test_values_in_redis_that_are_no_counters_fail_no_scrape(redis: Redis) -> None:
    """A counter past 64 bits (past a float's range, prometheus-client's rendering failed),
    a report nested past Python's stack or holding such a number, a gateway id that is not
    UTF-8: the scrape answers with the rest, for everyone."""
    keys = Keys(f"t{uuid.uuid4().hex[:8]}")
    view = CatalogView(keys)
    view.models = {"m": CatalogEntry("m", (1,), parse_config_text(CONFIG, model_name="m"))}
    huge = b"9" * 400
    await redis.hset(
        keys.stats("m", 1),
        mapping={
            st.RECLAIMED: huge,
            st.count_field("success"): huge,
            st.DEAD_LETTERED: b"7",
            "h.tq.team-a.sum": huge,
        },
    )
    await redis.hset(keys.gateway_counters, mapping={"tenant.requests:team-a": huge})
    big_counter = {
        "name": "my_counter",
        "description": "d",
        "kind": "counter",
        "series": [
            {
                "labels": {},
                "value": int(huge),
                "set_at": 0,
                "buckets": [],
                "counts": [],
                "sum": 0,
                "count": 0,
            }
        ],
    }
    await redis.hset(
        keys.custom_metrics,
        mapping={
            "deep": b"[" * 100_000,
            "big": json.dumps({"families": [big_counter]}).encode(),
            "nan": b'{"families": [{"name": "h", "description": "d", "kind": "histogram", '
            b'"series": [{"labels": {}, "value": 0, "set_at": 0, "buckets": [1], '
            b'"counts": [1, 2], "sum": 1, "count": Infinity}]}]}',
        },
    )
    # (live workers' reports: a report without an expiry ahead is not read at all)
    await redis.zadd(keys.custom_metrics_expiry, dict.fromkeys(("deep", "big", "nan"), 2e9))
    await redis.zadd(keys.gateways, {b"\xff\xfe": time.time() + 60})

    taken = await snapshot.take(redis, keys, view)
    text = exposition._text(taken, GatewaySettings(), TenantLimits(), ("team-a",))
    found = families(text)
    assert [s.value for s in found["sluice_dead_letter_entries"]] == [7]
    assert [s.value for s in found["sluice_reclaimed_entries"]] == [0]  # (left out: none)
    assert found.get("my_counter", []) == [] and found.get("h", []) == []


class _Control:
    """A control plane whose snapshot waits until released, counting the reads."""

    def __init__(self) -> None:
        self.reads = 0
        self.release = asyncio.Event()

    async def metric_snapshot(self, view: CatalogView) -> Snapshot:
        self.reads += 1
        await self.release.wait()
        return Snapshot([VersionState("m", 1, {}, [StreamState(0)])], 0, [], {})


def _state(control: _Control) -> GatewayState:
    return cast(
        GatewayState,
        SimpleNamespace(
            control=control,
            view=None,
            settings=GatewaySettings(),
            quota=SimpleNamespace(limits=TenantLimits(), tenants=("anonymous",)),
            scrape=None,
        ),
    )


async def test_scrapes_that_arrive_together_read_redis_once() -> None:
    """Without API keys nobody needs one to scrape: a hundred clients scraping at once
    cost one read of every model's hashes and streams and one rendering, not a hundred."""
    control = _Control()
    state = _state(control)
    scrapes = [asyncio.create_task(exposition.metrics_text(state)) for _ in range(100)]
    await asyncio.sleep(0.05)
    scrapes[0].cancel()  # (its client went away: the others' scrape goes on)
    control.release.set()
    texts = await asyncio.gather(*scrapes[1:])
    assert control.reads == 1
    assert len(set(texts)) == 1 and b"sluice_stream_length" in texts[0]
    # A scrape after that one reads again.
    await exposition.metrics_text(state)
    assert control.reads == 2


def test_the_drain_rate_keeps_a_sample_a_second_and_forgets_unserved_versions() -> None:
    """However often scrapes come, a version keeps a window's worth of samples, and the
    versions no longer served are forgotten."""
    drain = sluice_families.DrainRate(window_s=60)
    for step in range(100_000):  # a thousand scrapes a second for 100 s
        drain.rate(("m", 1), step, now=step / 1000)
    assert len(drain.seen[("m", 1)]) <= 62
    assert drain.rate(("m", 1), 100_000, now=100.0) == pytest.approx(1000, rel=0.05)
    sluice_families.DRAIN.seen.clear()
    for name in ("a", "b"):
        sluice_families.render(
            Snapshot([VersionState(name, 1, {}, [StreamState(0)])], 0, [], {}), None
        )
    assert list(sluice_families.DRAIN.seen) == [("b", 1)]


def test_tenant_queue_histograms_of_tenants_that_no_longer_exist_are_left_out() -> None:
    counters = {"h.tq.team-a.0": 1, "h.tq.team-a.sum": 1, "h.tq.gone.0": 1, "h.tq.gone.sum": 1}
    state = VersionState("m", 1, counters, [StreamState(0)])
    found = families(sluice_families.render(Snapshot([state], 0, [], {}), None, ("team-a",)))
    assert {s.labels["tenant"] for s in found["sluice_tenant_queue_duration_seconds"]} == {"team-a"}


def test_the_statistics_extension_answers_despite_malformed_counters() -> None:
    """``/v2/models/{m}/stats`` reads the same hashes: a value that is no integer counts 0
    instead of failing every client's answer with 500."""
    counters = {
        st.count_field("success").encode(): b"x",
        st.INFERENCE_COUNT.encode(): b"5",
        b"response.0.success.count": b"1.5",
    }
    batches = {b"junk": b"1", st.batch_field(4, "compute_infer", "count").encode(): b"?"}
    stats = st.render_model_stats("m", 1, counters, batches, {b"\xff": b"x"})
    assert stats["inference_count"] == 5
    assert stats["inference_stats"]["success"]["count"] == 0
    assert [b["batch_size"] for b in stats["batch_stats"]] == [4]
    assert stats["instance_stats"][0]["execution_count"] == 0


async def test_the_metrics_port_answers_503_while_redis_is_unreachable() -> None:
    class Unreachable(_Control):
        async def metric_snapshot(self, view: CatalogView) -> Snapshot:
            raise RedisConnectionError("Connection refused")

    app = FastAPI()
    app.state.sluice = _state(Unreachable())
    transport = httpx.ASGITransport(app=MetricsOnly(app))
    async with httpx.AsyncClient(transport=transport, base_url="http://metrics") as client:
        answer = await client.get("/metrics")
    assert answer.status_code == 503
    assert "Redis" in answer.json()["error"]
