"""Triton's metric families with model namespacing (``--model-namespacing=true``): each
copy of a name several repositories hold is labelled as Triton labels it, by that name and
by its repository (``namespace``), never by Sluice's internal name for it; its series and
the other copy's stay apart. Without the repositories known, the internal name is kept."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import pytest
from prometheus_client.parser import text_string_to_metric_families
from redis.asyncio import Redis

from sluice.core.catalog import CatalogEntry
from sluice.core.config.parse import parse_config_text
from sluice.core.keys import Keys
from sluice.core.observability import statistics as st
from sluice.core.repository_namespaces import ambiguity
from sluice.core.settings import GatewaySettings
from sluice.core.tenant_limits import TenantLimits
from sluice.gateway.control.catalog_view import CatalogView
from sluice.gateway.metrics import exposition, snapshot
from sluice.scheduler.executor.redis_server import RedisServer

REPOSITORIES = ("/models/addsub", "/models/subadd")


@pytest.fixture
async def redis(redis_server: RedisServer) -> AsyncIterator[Redis]:
    client = Redis.from_url(redis_server.url)
    yield client
    await client.aclose()


def _entry(name: str, listed_as: str = "") -> CatalogEntry:
    config = parse_config_text(
        f'name: "{name}"\nbackend: "python"\nmax_batch_size: 0\n', model_name=name
    )
    return CatalogEntry(name, (1,), config, listed_as=listed_as)


async def _scrape(redis: Redis, repositories: tuple[str, ...]) -> str:
    """``alone``, and ``comp`` held by both repositories (its second copy answered 3)."""
    keys = Keys(f"t{uuid.uuid4().hex[:8]}")
    view = CatalogView(keys, namespacing=True)
    view.models = {
        "alone": _entry("alone"),
        "comp@1": _entry("comp@1", "comp"),
        "comp@2": _entry("comp@2", "comp"),
        "comp": CatalogEntry("comp", (), None, ambiguity("comp", 2), ambiguous=True),
    }
    await redis.hset(keys.stats("comp@2", 1), mapping={st.count_field("success"): 3})
    taken = await snapshot.take(redis, keys, view)
    settings = GatewaySettings(model_repository=repositories)
    return exposition._text(taken, settings, TenantLimits(), ()).decode()


def _success(text: str) -> list[tuple[dict[str, str], float]]:
    found = {family.name: family.samples for family in text_string_to_metric_families(text)}
    return [(sample.labels, sample.value) for sample in found["nv_inference_request_success"]]


async def test_a_copy_is_labelled_by_its_name_and_its_repository(redis: Redis) -> None:
    text = await _scrape(redis, REPOSITORIES)
    assert _success(text) == [
        ({"model": "alone", "version": "1"}, 0),
        ({"model": "comp", "namespace": "/models/addsub", "version": "1"}, 0),
        ({"model": "comp", "namespace": "/models/subadd", "version": "1"}, 3),
    ]
    assert 'nv_inference_request_success{model="alone",version="1"} 0\n' in text
    assert (
        'nv_inference_request_failure{model="comp",namespace="/models/subadd",version="1",'
        'reason="BACKEND"} 0\n'
    ) in text
    assert "comp@" not in "".join(line for line in text.splitlines() if line.startswith("nv_"))


async def test_without_the_repositories_a_copy_keeps_its_internal_name(redis: Redis) -> None:
    assert _success(await _scrape(redis, ())) == [
        ({"model": "alone", "version": "1"}, 0),
        ({"model": "comp@1", "version": "1"}, 0),
        ({"model": "comp@2", "version": "1"}, 3),
    ]
