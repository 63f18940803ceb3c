"""Triton's metric families with model namespacing (``--model-namespacing=true``): every
model is labelled as Triton's metric reporter labels it, by its name and by its repository
(``namespace``), which the catalog records; a copy of a name several repositories hold by
that name, never by Sluice's internal name for it, its series and the other copy's kept
apart. With one repository, that repository; without namespacing, no ``namespace``."""

from __future__ import annotations

import uuid

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

REPOSITORIES = ("/models/addsub", "/models/subadd")


def _entry(name: str, listed_as: str = "", namespace: str = "") -> CatalogEntry:
    config = parse_config_text(
        f'name: "{name}"\nbackend: "python"\nmax_batch_size: 0\n', model_name=name
    )
    return CatalogEntry(name, (1,), config, listed_as=listed_as, namespace=namespace)


async def _scrape(redis: Redis, view: CatalogView, repositories: tuple[str, ...] = ()) -> str:
    await redis.hset(view.keys.stats("comp@2", 1), mapping={st.count_field("success"): 3})
    taken = await snapshot.take(redis, view.keys, view)
    settings = GatewaySettings(model_repository=repositories)
    return exposition._text(taken, settings, TenantLimits(), ()).decode()


def _joined() -> CatalogView:
    """``alone`` (the first repository's), and ``comp`` held by both repositories (its
    second copy answered 3), as the catalog of a view joining them records them."""
    first, second = REPOSITORIES
    view = CatalogView(Keys(f"t{uuid.uuid4().hex[:8]}"), namespacing=True)
    view.models = {
        "alone": _entry("alone", namespace=first),
        "comp@1": _entry("comp@1", "comp", first),
        "comp@2": _entry("comp@2", "comp", second),
        "comp": CatalogEntry("comp", (), None, ambiguity("comp", 2), ambiguous=True),
    }
    return view


def _success(text: str) -> list[tuple[dict[str, str], float]]:
    found = {family.name: family.samples for family in text_string_to_metric_families(text)}
    return [(sample.labels, sample.value) for sample in found["nv_inference_request_success"]]


async def test_every_model_is_labelled_by_its_name_and_its_repository(redis: Redis) -> None:
    text = await _scrape(redis, _joined())
    assert _success(text) == [
        ({"model": "alone", "namespace": "/models/addsub", "version": "1"}, 0),
        ({"model": "comp", "namespace": "/models/addsub", "version": "1"}, 0),
        ({"model": "comp", "namespace": "/models/subadd", "version": "1"}, 3),
    ]
    assert 'nv_inference_request_success{model="alone",namespace="/models/addsub",' in text
    assert (
        'nv_inference_request_failure{model="comp",namespace="/models/subadd",version="1",'
        'reason="BACKEND"} 0\n'
    ) in text
    assert "comp@" not in "".join(line for line in text.splitlines() if line.startswith("nv_"))


async def test_a_gateway_not_told_the_repositories_labels_them_from_the_catalog(
    redis: Redis,
) -> None:
    """The catalog says which repository holds each model: a gateway started apart, without
    ``SLUICE_MODEL_REPOSITORY``, labels as one ``sluice up`` starts."""
    assert _success(await _scrape(redis, _joined(), ())) == _success(
        await _scrape(redis, _joined(), REPOSITORIES)
    )


async def test_with_one_repository_every_model_is_in_it(redis: Redis) -> None:
    view = CatalogView(
        Keys(f"t{uuid.uuid4().hex[:8]}"), namespacing=True, sole_repository="/models/one"
    )
    view.models = {"alone": _entry("alone")}
    assert _success(await _scrape(redis, view)) == [
        ({"model": "alone", "namespace": "/models/one", "version": "1"}, 0)
    ]


async def test_without_namespacing_no_model_has_a_namespace(redis: Redis) -> None:
    view = CatalogView(Keys(f"t{uuid.uuid4().hex[:8]}"), sole_repository="/models/one")
    view.models = {"alone": _entry("alone")}
    assert _success(await _scrape(redis, view)) == [({"model": "alone", "version": "1"}, 0)]


def _series(text: str, prefix: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Every family of ``text`` whose name starts with ``prefix``: its samples' labels and
    values."""
    return {
        family.name: [(sample.labels, sample.value) for sample in family.samples]
        for family in text_string_to_metric_families(text)
        if family.name.startswith(prefix)
    }


async def _scrape_all(redis: Redis, view: CatalogView) -> str:
    """The whole text, TorchServe's families included."""
    await redis.hset(view.keys.stats("comp@2", 1), mapping={st.count_field("success"): 3})
    taken = await snapshot.take(redis, view.keys, view)
    settings = GatewaySettings(torchserve_metrics=True)
    return exposition._text(taken, settings, TenantLimits(), ()).decode()


async def test_sluices_and_torchserves_families_name_a_copy_as_its_clients_do(
    redis: Redis,
) -> None:
    """Sluice's and TorchServe's families label a copy by the name clients use and by its
    repository, as Triton's do: never by Sluice's internal name for it. Every series of a
    family has the same labels."""
    text = await _scrape_all(redis, _joined())
    first, second = REPOSITORIES
    assert "comp@" not in text
    lag = _series(text, "sluice_consumer_lag")["sluice_consumer_lag"]
    assert [labels for labels, _ in lag] == [
        {"model": "alone", "namespace": first, "version": "1"},
        {"model": "comp", "namespace": first, "version": "1"},
        {"model": "comp", "namespace": second, "version": "1"},
    ]
    requests = _series(text, "ts_inference_requests")["ts_inference_requests"]
    assert [
        (labels["model_name"], labels["namespace"], labels["model_version"], value)
        for labels, value in requests
    ] == [("alone", first, "1.0", 0), ("comp", first, "1.0", 0), ("comp", second, "1.0", 3)]
    for name, samples in {**_series(text, "sluice_"), **_series(text, "ts_")}.items():
        per_model = [
            labels for labels, _ in samples if "version" in labels or "model_name" in labels
        ]
        keys = {frozenset(labels) - {"le"} for labels in per_model}
        assert len(keys) <= 1, (name, keys)
        assert all(labels.get("namespace") in REPOSITORIES for labels in per_model), name


async def test_without_namespacing_sluices_families_have_no_namespace(redis: Redis) -> None:
    view = CatalogView(Keys(f"t{uuid.uuid4().hex[:8]}"), sole_repository="/models/one")
    view.models = {"alone": _entry("alone")}
    text = await _scrape_all(redis, view)
    assert _series(text, "sluice_consumer_lag")["sluice_consumer_lag"] == [
        ({"model": "alone", "version": "1"}, 0)
    ]
    (requests,) = _series(text, "ts_inference_requests").values()
    assert "namespace" not in requests[0][0]
