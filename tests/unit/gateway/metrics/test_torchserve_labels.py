"""TorchServe's metric families (``SLUICE_TORCHSERVE_METRICS``) label ``model_version`` with
TorchServe's name for the version (its manifest's text: ``1.0``, ``v1``), as its
description shows it and its routes name it, not with Sluice's folder number."""

from __future__ import annotations

import dataclasses
import uuid

from prometheus_client.parser import text_string_to_metric_families
from redis.asyncio import Redis

from sluice.core.catalog import CatalogEntry
from sluice.core.config.parse import parse_config_text
from sluice.core.keys import Keys
from sluice.core.observability.statistics import count_field, ns_field
from sluice.core.torchserve.versions import VersionRecord
from sluice.gateway.control.catalog_view import CatalogView
from sluice.gateway.metrics import snapshot
from sluice.gateway.metrics.torchserve_families import torchserve_lines

CONFIG = 'name: "{}"\nbackend: "python"\nmax_batch_size: 0\n'


def _entry(name: str, versions: dict[int, str]) -> CatalogEntry:
    """Model ``name`` serving ``versions`` (number -> TorchServe's version; "": none
    recorded, as for a model laid out by hand)."""
    config = parse_config_text(CONFIG.format(name), model_name=name)
    parameters: dict[str, str] = {}
    for number, version in versions.items():
        parameters |= VersionRecord(version).parameters(number)
    return CatalogEntry(name, tuple(versions), dataclasses.replace(config, parameters=parameters))


async def test_model_version_is_torchserve_s_version_text(redis: Redis) -> None:
    keys = Keys(f"t{uuid.uuid4().hex[:8]}")
    view = CatalogView(keys)
    view.models = {
        "ts": _entry("ts", {1: "1.0", 2: "v1", 3: 'odd "2"'}),
        "plain": _entry("plain", {4: ""}),
    }
    await redis.hset(
        keys.stats("ts", 2), mapping={count_field("success"): 3, ns_field("queue"): 7000}
    )
    await redis.hset(keys.stats("plain", 4), mapping={count_field("fail"): 2})
    taken = await snapshot.take(redis, keys, view)
    text = "\n".join(torchserve_lines(taken, "host-a")) + "\n"
    samples = {
        (family.name, sample.labels["model_name"], sample.labels["model_version"]): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }
    requests = {
        key[1:]: value for key, value in samples.items() if key[0] == "ts_inference_requests"
    }
    assert requests == {
        ("ts", "1.0"): 0,
        ("ts", "v1"): 3,
        ("ts", 'odd "2"'): 0,
        ("plain", "4.0"): 2,  # (no version text recorded: TorchServe's API calls it 4.0)
    }
    assert samples["ts_queue_latency_microseconds", "ts", "v1"] == 7
