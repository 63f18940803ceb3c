"""``sluice_instances`` of a model whose load failed: the version that failed counts its
expected instances as ``failed``; a version released with it (Triton lists it
``unloaded``) expects none, so it is neither failed nor loading."""

from __future__ import annotations

import uuid

from prometheus_client.parser import text_string_to_metric_families
from redis.asyncio import Redis

from sluice.core.catalog import UNLOADED, CatalogEntry
from sluice.core.config.parse import parse_config_text
from sluice.core.keys import Keys, load_error_field
from sluice.core.settings import GatewaySettings
from sluice.core.tenant_limits import TenantLimits
from sluice.gateway.control.catalog_view import CatalogView
from sluice.gateway.metrics import exposition, snapshot


async def test_a_version_released_with_a_failed_one_is_not_counted_failed(redis: Redis) -> None:
    config = parse_config_text(
        'name: "m"\nbackend: "python"\nmax_batch_size: 0\n'
        "instance_group [ { count: 2 kind: KIND_CPU } ]\n",
        model_name="m",
    )
    view = CatalogView(Keys(f"t{uuid.uuid4().hex[:8]}"))
    view.models = {"m": CatalogEntry("m", (1, 2), config)}
    view.load_errors = {
        load_error_field("m", 1): UNLOADED,
        load_error_field("m", 2): "its worker exited while loading",
    }
    taken = await snapshot.take(redis, view.keys, view)
    text = exposition._text(taken, GatewaySettings(), TenantLimits(), ()).decode()
    instances = {
        (sample.labels["version"], sample.labels["state"]): sample.value
        for family in text_string_to_metric_families(text)
        if family.name == "sluice_instances"
        for sample in family.samples
    }
    assert instances == {
        ("1", "ready"): 0,
        ("1", "loading"): 0,
        ("1", "failed"): 0,
        ("2", "ready"): 0,
        ("2", "loading"): 0,
        ("2", "failed"): 2,
    }
