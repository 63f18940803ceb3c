"""Metrics a model defines itself (:mod:`sluice.core.observability.custom_metrics`), through
Triton's ``pb_utils.MetricFamily``: what each kind does, what is refused, how long a series
lives (as long as the family object that made it, as in Triton), and how the reports of
several workers become one family each on ``/metrics``."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from sluice.core.observability import custom_metrics as cm
from sluice.workers.backends import triton_python_backend_utils as pb_utils

KEPT: list[pb_utils.MetricFamily] = []
"""Families the one-line cases keep alive (a family deleted deletes its metrics)."""


@pytest.fixture(autouse=True)
def fresh_registry(monkeypatch: pytest.MonkeyPatch) -> Iterator[cm.Registry]:
    registry = cm.Registry()
    monkeypatch.setattr(cm, "REGISTRY", registry)
    yield registry
    KEPT.clear()


def kept(family: pb_utils.MetricFamily) -> Any:
    """``family``, kept until the test ends (Any: the cases call it with what it refuses)."""
    KEPT.append(family)
    return family


def names(registry: cm.Registry) -> dict[str, list[dict[str, str]]]:
    """Each family reported, with the labels of its series."""
    return {f["name"]: [s["labels"] for s in f["series"]] for f in registry.snapshot()}


def test_each_kind_through_tritons_api(fresh_registry: cm.Registry) -> None:
    kinds = pb_utils.MetricFamily
    tokens = kinds("tokens", "Tokens made", kinds.COUNTER)
    counter = tokens.Metric(labels={"model": "m"})
    counter.increment(2)
    counter.increment(0.5)
    assert counter.value() == 2.5
    kv_use = kinds("kv_use", "Cache use", kinds.GAUGE)
    gauge = kv_use.Metric()
    gauge.set(0.75)
    gauge.increment(-0.25)  # (a gauge may go down)
    assert gauge.value() == 0.5
    wait_ms = kinds("wait_ms", "Wait", kinds.HISTOGRAM)
    histogram = wait_ms.Metric(buckets=[1, 5])
    for value in (0.5, 1, 3, 9):
        histogram.observe(value)
    lines = cm.render([fresh_registry.snapshot()])
    assert 'tokens{model="m"} 2.5' in lines and "kv_use 0.5" in lines
    assert lines[lines.index("# TYPE wait_ms histogram") + 1 :] == [
        'wait_ms_bucket{le="1"} 2',
        'wait_ms_bucket{le="5"} 3',
        'wait_ms_bucket{le="+Inf"} 4',
        "wait_ms_sum 13.5",
        "wait_ms_count 4",
    ]
    # The same family and labels again are the same metric.
    same = kinds("tokens", "Tokens made", kinds.COUNTER)
    again = same.Metric(labels={"model": "m"})
    again.increment(1)
    assert counter.value() == 3.5


@pytest.mark.parametrize(
    ("make", "text"),
    [
        (lambda k: k("bad name", "", k.COUNTER), "invalid metric family name"),
        (lambda k: k("nv_inference_count", "", k.COUNTER), "are the server's"),
        (lambda k: k("sluice_x", "", k.GAUGE), "are the server's"),
        (lambda k: k("x", "", 7), "invalid metric family kind"),
        (lambda k: kept(k("c", "", k.COUNTER)).Metric().increment(-1), "cannot decrease"),
        (lambda k: kept(k("c", "", k.COUNTER)).Metric().set(1), "only a gauge is set"),
        (lambda k: kept(k("c", "", k.COUNTER)).Metric().observe(1), "only a histogram observes"),
        (lambda k: kept(k("c", "", k.COUNTER)).Metric().increment(float("nan")), "finite"),
        (lambda k: kept(k("c", "", k.COUNTER)).Metric().increment("1"), "a number"),
        (lambda k: kept(k("c", "", k.COUNTER)).Metric(labels={"1x": "v"}), "invalid label name"),
        (lambda k: kept(k("c", "", k.COUNTER)).Metric(labels={"le": "v"}), "invalid label name"),
        (lambda k: kept(k("c", "", k.COUNTER)).Metric(labels={"a": 1}), "must be a string"),
        (lambda k: kept(k("c", "", k.COUNTER)).Metric(labels={"a": "x" * 257}), "at most 256"),
        # (each label adds to every report: a series' labels are bounded, as its values)
        (
            lambda k: kept(k("c", "", k.COUNTER)).Metric(labels={f"l{i}": "v" for i in range(17)}),
            "at most 16 labels",
        ),
        (lambda k: k("c", "d" * 1025, k.COUNTER), "longer than 1024 characters"),
        (lambda k: kept(k("c", "", k.COUNTER)).Metric(buckets=[1]), "only a histogram has buckets"),
        (lambda k: kept(k("h", "", k.HISTOGRAM)).Metric(), "needs buckets"),
        (lambda k: kept(k("h", "", k.HISTOGRAM)).Metric(buckets=[2, 1]), "increasing"),
        (lambda k: kept(k("h", "", k.HISTOGRAM)).Metric(buckets=[]), "1 to 64 buckets"),
        (lambda k: kept(k("h", "", k.HISTOGRAM)).Metric(buckets=[1]).value(), "no single value"),
    ],
)
def test_what_a_model_cannot_ask_for_raises_tritons_exception(make: object, text: str) -> None:
    with pytest.raises(pb_utils.TritonModelException, match=text):
        make(pb_utils.MetricFamily)  # type: ignore[operator]


def test_a_family_name_keeps_its_kind_and_description() -> None:
    kinds = pb_utils.MetricFamily
    held = kinds("x", "One", kinds.COUNTER)
    with pytest.raises(pb_utils.TritonModelException, match="another kind or description"):
        kinds("x", "One", kinds.GAUGE)
    with pytest.raises(pb_utils.TritonModelException, match="another kind or description"):
        kinds("x", "Two", kinds.COUNTER)
    del held  # (the name is free once no object holds it)
    kinds("x", "Two", kinds.GAUGE)


def test_series_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cm, "MAX_SERIES", 3)
    family = pb_utils.MetricFamily("x", "", pb_utils.MetricFamily.COUNTER)
    for index in range(3):
        family.Metric(labels={"i": str(index)})
    family.Metric(labels={"i": "0"})  # (one that exists is no new series)
    with pytest.raises(pb_utils.TritonModelException, match="more than 3 metrics"):
        family.Metric(labels={"i": "3"})


def _report(kind: str, series: list[dict[str, object]], name: str = "x") -> list[object]:
    return [{"name": name, "description": "X", "kind": kind, "series": series}]


def _series(value: float = 0, set_at: float = 0, **extra: object) -> dict[str, object]:
    return {
        "labels": {"a": "b"},
        "value": value,
        "set_at": set_at,
        "buckets": [],
        "counts": [],
        "sum": 0,
        "count": 0,
        **extra,
    }


def test_workers_reports_merge_by_kind() -> None:
    counters = [_report("counter", [_series(2)]), _report("counter", [_series(3)])]
    assert cm.render(counters)[-1] == 'x{a="b"} 5'
    gauges = [_report("gauge", [_series(7, set_at=20)]), _report("gauge", [_series(9, set_at=10)])]
    assert cm.render(gauges)[-1] == 'x{a="b"} 7'  # (the value set last)
    one = _series(buckets=[1], counts=[1, 2], sum=4, count=3)
    other = _series(buckets=[1], counts=[2, 0], sum=1, count=2)
    odd = _series(buckets=[5], counts=[9, 9], sum=9, count=18)
    lines = cm.render([_report("histogram", [s]) for s in (one, other, odd)])
    assert lines[2:] == [
        'x_bucket{a="b",le="1"} 3',
        'x_bucket{a="b",le="+Inf"} 5',
        'x_sum{a="b"} 5',
        'x_count{a="b"} 5',
    ]  # (a worker's series with other buckets is left out)


def test_what_a_report_must_not_carry_is_left_out() -> None:
    bad_labels = _series(1)
    bad_labels["labels"] = {"bad label": "x"}
    reports = [
        _report("counter", [_series(1)], name="nv_inference_count"),
        _report("counter", [_series(1)], name="bad name"),
        _report("summary", [_series(1)]),
        _report("gauge", [_series(1)]),
        _report("counter", [_series(4)]),  # (x is a gauge already: another kind)
        _report("gauge", [bad_labels], name="y"),
        [{"name": "z"}],
        ["not a family"],
    ]
    lines = cm.render(reports)  # type: ignore[arg-type]
    # (y: its only series left out, a family with no series is not written)
    assert lines == ["# HELP x X", "# TYPE x gauge", 'x{a="b"} 1']


def test_unreadable_reports_are_left_out() -> None:
    live = cm.encode_report(_report("counter", [_series(1)]))  # type: ignore[arg-type]
    raw = [live, b"{not json", json.dumps({}).encode(), json.dumps({"families": 3}).encode()]
    assert len(cm.decode_reports(raw)) == 1


def test_deleting_a_family_deletes_its_series_and_its_metrics_raise(
    fresh_registry: cm.Registry,
) -> None:
    """Triton's lifetime: a ``MetricFamily`` object keeps the metrics made through it (one
    dropped stays while its family lives), and deleting the family deletes them all, from
    the report too; the ``Metric`` objects left raise Triton's error on every operation."""
    kinds = pb_utils.MetricFamily
    family = kinds("queue_depth", "Depth", kinds.GAUGE)
    first = family.Metric(labels={"q": "a"})
    family.Metric(labels={"q": "b"}).set(2)  # (its Metric object dropped at once)
    first.set(1)
    assert names(fresh_registry) == {"queue_depth": [{"q": "a"}, {"q": "b"}]}
    del family
    assert names(fresh_registry) == {}
    assert not fresh_registry
    for operation in (lambda: first.set(3), lambda: first.increment(1), first.value):
        with pytest.raises(pb_utils.TritonModelException) as raised:
            operation()
        assert str(raised.value) == (
            "Invalid metric operation as the corresponding 'MetricFamily' has been deleted. "
            "The 'MetricFamily' object should be deleted AFTER its corresponding 'Metric' "
            "objects have been deleted."
        )
    # The name is free again, for another kind even.
    again = kinds("queue_depth", "Depth", kinds.COUNTER)
    again.Metric().increment(1)
    assert names(fresh_registry) == {"queue_depth": [{}]}


def test_a_series_two_family_objects_made_stays_until_both_are_deleted(
    fresh_registry: cm.Registry,
) -> None:
    """Two objects of one family making the same series share it (Triton counts its
    references): it stays, with its value, until the last of them is deleted."""
    kinds = pb_utils.MetricFamily
    one = kinds("served", "Served", kinds.COUNTER)
    other = kinds("served", "Served", kinds.COUNTER)
    one.Metric(labels={"m": "x"}).increment(2)
    other.Metric(labels={"m": "x"}).increment(3)
    other.Metric(labels={"m": "y"})
    del other
    [family] = fresh_registry.snapshot()
    assert [(s["labels"], s["value"]) for s in family["series"]] == [({"m": "x"}, 5.0)]
    del one
    assert fresh_registry.snapshot() == []


def test_deleted_series_make_room(
    fresh_registry: cm.Registry, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The bound counts the series reported: a model that makes its families afresh (one
    per request, say) is never refused for those it deleted."""
    monkeypatch.setattr(cm, "MAX_SERIES", 2)
    for round_ in range(5):
        family = pb_utils.MetricFamily("per_request", "", pb_utils.MetricFamily.COUNTER)
        family.Metric(labels={"i": "0"}).increment(round_)
        family.Metric(labels={"i": "1"})
        del family
    assert fresh_registry.snapshot() == []


def test_a_release_while_the_registry_is_in_use_waits_for_its_next_use(
    fresh_registry: cm.Registry,
) -> None:
    """A family's ``__del__`` may run on any thread at any allocation, within the
    registry's own locked work included: it only queues, and the next use settles it."""
    kinds = pb_utils.MetricFamily
    family = kinds("late", "", kinds.COUNTER)
    family.Metric()
    with fresh_registry._lock:  # (as a collection during a snapshot would run it)
        del family
    assert fresh_registry.snapshot() == []
