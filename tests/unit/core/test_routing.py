"""Version labels and traffic splits: validation of what clients send, the Redis codec, the
weighted choice (seeded), and which version a request goes to when one is not ready."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from redis.asyncio import Redis

from sluice.core.catalog import CatalogEntry
from sluice.core.config.parse import parse_config_text
from sluice.core.errors import InvalidInput, Unavailable
from sluice.core.keys import Keys
from sluice.core.routing import (
    MAX_LABELS,
    Routing,
    Split,
    check_label,
    decode_routing,
    encode_routing,
    parameter_label,
    parse_labels,
    parse_weights,
    requested_label,
)
from sluice.gateway.control.catalog_view import CatalogView
from sluice.gateway.control.routing_view import RoutingView
from tests.support.onnx_models import identity_config

MODEL = "m"
SERVED = (1, 2, 3)


@pytest.mark.parametrize("label", ["a", "production", "v2", "canary-1", "a.b_c-d", "0" + "x" * 62])
def test_valid_labels(label: str) -> None:
    assert check_label(label) == label


@pytest.mark.parametrize(
    "label",
    ["", "Production", "-a", "_a", ".a", "a b", "a/b", "a:b", "é", "a" * 64, "a\n", "\x00"],
)
def test_invalid_labels_are_refused_naming_the_pattern(label: str) -> None:
    with pytest.raises(InvalidInput, match=r"is not a valid label: it must match \[a-z0-9\]"):
        check_label(label)


def test_parse_labels() -> None:
    assert parse_labels({"production": 1, "staging": 3}, SERVED, MODEL) == {
        "production": 1,
        "staging": 3,
    }
    assert parse_labels({}, SERVED, MODEL) == {}


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ([], "'labels' must be an object"),
        ({"Prod": 1}, "'labels': 'Prod' is not a valid label"),
        ({"prod": True}, r"'labels.prod' must be a model version \(an integer\)"),
        ({"prod": "1"}, r"'labels.prod' must be a model version \(an integer\)"),
        ({"prod": 1.0}, r"'labels.prod' must be a model version"),
        ({"prod": None}, r"'labels.prod' must be a model version"),
        ({"prod": 0}, r"'labels.prod' must be a model version \(a positive integer\)"),
        ({"prod": -1}, r"'labels.prod' must be a model version"),
        ({"prod": 1 << 70}, r"'labels.prod' must be a model version"),
        ({"prod": 4}, r"version 4 of model 'm' is not served \(served versions: 1, 2, 3\)"),
        ({f"l{i}": 1 for i in range(MAX_LABELS + 1)}, f"a model may have {MAX_LABELS}"),
    ],
)
def test_bad_labels_are_refused_naming_the_field(value: object, message: str) -> None:
    with pytest.raises(InvalidInput, match=message):
        parse_labels(value, SERVED, MODEL)


def test_parse_weights() -> None:
    assert parse_weights({"1": 90, "3": 10}, SERVED, MODEL) == {1: 90, 3: 10}
    assert parse_weights({"2": 0, "3": 1000}, SERVED, MODEL) == {2: 0, 3: 1000}
    assert parse_weights({}, SERVED, MODEL) == {}  # clears the split
    assert parse_weights({"01": 5}, SERVED, MODEL) == {1: 5}


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ([90, 10], "'weights' must be an object"),
        ({"x": 1}, r"'weights' key 'x' must be a model version"),
        ({"-1": 1}, r"'weights' key '-1' must be a model version"),
        ({"1.0": 1}, r"'weights' key '1.0' must be a model version"),
        ({"0": 1}, r"'weights' key '0' must be a model version"),
        ({"9" * 5000: 1}, r"'weights' key '9999.* must be a model version"),
        ({"4": 1}, "version 4 of model 'm' is not served"),
        ({"1": True}, r"'weights.1' must be an integer from 0 to 1000"),
        ({"1": 1.5}, r"'weights.1' must be an integer from 0 to 1000"),
        ({"1": "10"}, r"'weights.1' must be an integer from 0 to 1000"),
        ({"1": -1}, r"'weights.1' must be an integer from 0 to 1000"),
        ({"1": 1001}, r"'weights.1' must be an integer from 0 to 1000"),
        ({"1": 1, "01": 2}, "'weights' names version 1 twice"),
        ({"1": 0, "2": 0}, "at least one version a weight above 0"),
    ],
)
def test_bad_weights_are_refused_naming_the_field(value: object, message: str) -> None:
    with pytest.raises(InvalidInput, match=message):
        parse_weights(value, SERVED, MODEL)


def test_redis_fields_round_trip_and_bad_fields_are_skipped() -> None:
    routing = Routing({"production": 2, "canary": 3}, {2: 90, 3: 10})
    fields = encode_routing(routing)
    assert fields == {
        "label:production": "2",
        "label:canary": "3",
        "weight:2": "90",
        "weight:3": "10",
    }
    raw = {k.encode(): v.encode() for k, v in fields.items()}
    assert decode_routing(raw) == routing
    raw |= {b"label:Bad": b"1", b"weight:2x": b"5", b"weight:4": b"5000", b"other": b"1"}
    raw |= {b"label:x": b"not a number", b"\xff": b"1"}
    assert decode_routing(raw) == routing


def test_the_split_skips_zero_weights_and_none_without_any() -> None:
    assert Split.of({}) is None
    assert Split.of({1: 0}) is None
    split = Split.of({1: 0, 2: 3, 3: 1})
    assert split is not None and split.versions == (2, 3) and split.bounds == (3, 4)


def test_a_seeded_split_lands_near_its_weights() -> None:
    split = Split.of({1: 900, 2: 100})
    assert split is not None
    rng = random.Random(20240611)
    counts = Counter(split.draw(rng) for _ in range(100_000))
    assert set(counts) == {1, 2}
    assert abs(counts[2] - 10_000) < 500  # ~5 standard deviations (sd ≈ 95)
    three = Split.of({1: 1, 2: 1, 3: 2})
    assert three is not None
    counts = Counter(three.draw(rng) for _ in range(40_000))
    assert all(abs(counts[v] - share) < 600 for v, share in ((1, 10_000), (2, 10_000), (3, 20_000)))


def test_every_weight_boundary_is_reachable_and_exact() -> None:
    split = Split.of({1: 1, 2: 2})
    assert split is not None

    class Fixed(random.Random):
        def __init__(self, value: int) -> None:
            super().__init__()
            self.value = value

        def randrange(self, *args: object, **kwargs: object) -> int:
            return self.value

    assert [split.draw(Fixed(n)) for n in range(3)] == [1, 2, 2]


def test_the_url_header_and_parameter_must_agree() -> None:
    assert requested_label(None, None, None) is None
    assert requested_label(None, "prod", None) == "prod"
    assert requested_label(None, None, "prod") == "prod"
    assert requested_label(None, "prod", "prod") == "prod"
    with pytest.raises(InvalidInput, match="but the URL names version 2; name the version one way"):
        requested_label("2", None, "a")
    with pytest.raises(InvalidInput, match="the URL names label 'b'; name the version one way"):
        requested_label(None, "b", "a")
    assert parameter_label("prod", None, None) == "prod"
    assert parameter_label("prod", None, "prod") is None  # named already: nothing to do
    with pytest.raises(InvalidInput, match="parameter 'version_label' must be a string"):
        parameter_label(3, None, None)
    with pytest.raises(InvalidInput, match="the URL names version 2"):
        parameter_label("prod", "2", None)
    with pytest.raises(InvalidInput, match="also names label 'other'"):
        parameter_label("prod", None, "other")


def _view(ready: frozenset[int], routing: Routing | None = None, seed: int = 1) -> CatalogView:
    config = parse_config_text(identity_config(MODEL, ["FP32"], [-1], 8), model_name=MODEL)
    view = CatalogView(Keys("unit"))
    view.models = {MODEL: CatalogEntry(MODEL, SERVED, config)}
    view.ready = {MODEL: ready}
    view.routing = RoutingView(rng=random.Random(seed))
    if routing is not None:
        view.routing.apply(MODEL, routing)
    return view


def test_without_a_split_the_highest_ready_version_serves() -> None:
    view = _view(frozenset({1, 2}))
    assert {view.route(MODEL, None)[1] for _ in range(50)} == {2}


def test_the_split_spreads_requests_over_ready_versions() -> None:
    view = _view(frozenset(SERVED), Routing(weights={1: 90, 3: 10}))
    counts = Counter(view.route(MODEL, None)[1] for _ in range(10_000))
    assert set(counts) == {1, 3}
    assert abs(counts[3] - 1_000) < 150
    # Routes other than inference keep Triton's rule: the split is no version choice there.
    assert {view.resolve(MODEL, None)[1] for _ in range(50)} == {3}
    # A version or a label named by the request is not split.
    assert {view.route(MODEL, "2")[1] for _ in range(50)} == {2}


def test_a_drawn_version_that_is_not_ready_falls_back_to_the_highest_ready() -> None:
    view = _view(frozenset({1, 2}), Routing(weights={1: 50, 3: 50}))
    counts = Counter(view.route(MODEL, None)[1] for _ in range(4_000))
    assert set(counts) == {1, 2}  # 3 is not ready: its share goes to 2
    assert 1_800 < counts[2] < 2_200
    view.ready = {}  # nothing ready: Triton's rule (queue for the newest loadable version)
    assert {view.route(MODEL, None)[1] for _ in range(50)} == {3}


def test_labels_name_versions() -> None:
    view = _view(frozenset({1}), Routing(labels={"production": 1, "canary": 2, "gone": 7}))
    assert view.route(MODEL, None, "production")[1] == 1
    assert view.route(MODEL, None, "canary")[1] == 2  # loading: the request waits its turn
    with pytest.raises(InvalidInput, match="Unrecognized servable version label: 'nope' is not a"):
        view.route(MODEL, None, "nope")
    with pytest.raises(InvalidInput, match=r"labels: canary, gone, production\)"):
        view.route(MODEL, None, "nope")
    with pytest.raises(InvalidInput, match="is not a valid label"):
        view.route(MODEL, None, "NOPE")
    with pytest.raises(Unavailable, match="'m' version label 'gone' names version 7, which is not"):
        view.route(MODEL, None, "gone")
    other = _view(frozenset({1}))
    with pytest.raises(InvalidInput, match=r"model 'm' \(labels: none\)"):
        other.route(MODEL, None, "production")


async def test_the_view_reads_every_models_routing_in_one_refresh(redis: Redis) -> None:
    keys = Keys(f"unit{random.randrange(1 << 30)}")
    await redis.hset(keys.routing("a"), mapping={"label:prod": "1", "weight:1": "3"})
    await redis.hset(keys.routing("b"), mapping={"label:prod": "4"})
    await redis.hset(keys.routing("gone"), mapping={"label:prod": "4"})  # not in the catalog
    view = RoutingView()
    await view.refresh(redis, keys, ["a", "b", "c"])
    assert view.models == {"a": Routing({"prod": 1}, {1: 3}), "b": Routing({"prod": 4}, {})}
    assert set(view.splits) == {"a"} and view.draw("a") == 1 and view.draw("b") is None
    await redis.delete(keys.routing("a"))
    await view.refresh(redis, keys, ["a", "b", "c"])
    assert set(view.models) == {"b"} and view.splits == {}
    await redis.delete(keys.routing("b"), keys.routing("gone"))


def test_shadow_fields_round_trip() -> None:
    routing = Routing(weights={1: 100}, shadow={2: 25})
    fields = encode_routing(routing)
    assert fields == {"weight:1": "100", "shadow:2": "25"}
    raw = {k.encode(): v.encode() for k, v in fields.items()}
    raw |= {b"shadow:3": b"101", b"shadow:x": b"5"}  # out of range, not a version: skipped
    assert decode_routing(raw) == routing
    assert routing.to_json(MODEL)["shadow"] == {"2": 25}


def test_a_shadow_mirrors_its_share_to_a_ready_version_other_than_the_chosen() -> None:
    view = _view(frozenset({1, 2}), Routing(weights={1: 100}, shadow={2: 25}))
    mirrored = Counter(view.mirror(MODEL, 1) for _ in range(8_000))
    assert set(mirrored) == {None, 2}
    assert 1_700 < mirrored[2] < 2_300
    assert {view.mirror(MODEL, 2) for _ in range(100)} == {None}  # never to itself
    view.ready = {MODEL: frozenset({1})}  # the shadow version is not ready: no mirror
    assert {view.mirror(MODEL, 1) for _ in range(100)} == {None}
    assert {_view(frozenset({1, 2})).mirror(MODEL, 1) for _ in range(100)} == {None}
