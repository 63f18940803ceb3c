"""Metrics a model defines itself (:mod:`sluice.core.observability.custom_metrics`), through
Triton's ``pb_utils.MetricFamily``: what each kind does, what is refused, and how the
reports of several workers become one family each on ``/metrics``."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from sluice.core.observability import custom_metrics as cm
from sluice.workers.backends import triton_python_backend_utils as pb_utils


@pytest.fixture(autouse=True)
def fresh_registry(monkeypatch: pytest.MonkeyPatch) -> Iterator[cm.Registry]:
    registry = cm.Registry()
    monkeypatch.setattr(cm, "REGISTRY", registry)
    yield registry


def test_each_kind_through_tritons_api(fresh_registry: cm.Registry) -> None:
    kinds = pb_utils.MetricFamily
    counter = kinds("tokens", "Tokens made", kinds.COUNTER).Metric(labels={"model": "m"})
    counter.increment(2)
    counter.increment(0.5)
    assert counter.value() == 2.5
    gauge = kinds("kv_use", "Cache use", kinds.GAUGE).Metric()
    gauge.set(0.75)
    gauge.increment(-0.25)  # (a gauge may go down)
    assert gauge.value() == 0.5
    histogram = kinds("wait_ms", "Wait", kinds.HISTOGRAM).Metric(buckets=[1, 5])
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
    again = kinds("tokens", "Tokens made", kinds.COUNTER).Metric(labels={"model": "m"})
    again.increment(1)
    assert counter.value() == 3.5


@pytest.mark.parametrize(
    ("make", "text"),
    [
        (lambda k: k("bad name", "", k.COUNTER), "invalid metric family name"),
        (lambda k: k("nv_inference_count", "", k.COUNTER), "are the server's"),
        (lambda k: k("sluice_x", "", k.GAUGE), "are the server's"),
        (lambda k: k("x", "", 7), "invalid metric family kind"),
        (lambda k: k("c", "", k.COUNTER).Metric().increment(-1), "cannot decrease"),
        (lambda k: k("c", "", k.COUNTER).Metric().set(1), "only a gauge is set"),
        (lambda k: k("c", "", k.COUNTER).Metric().observe(1), "only a histogram observes"),
        (lambda k: k("c", "", k.COUNTER).Metric().increment(float("nan")), "finite"),
        (lambda k: k("c", "", k.COUNTER).Metric().increment("1"), "a number"),
        (lambda k: k("c", "", k.COUNTER).Metric(labels={"1x": "v"}), "invalid label name"),
        (lambda k: k("c", "", k.COUNTER).Metric(labels={"le": "v"}), "invalid label name"),
        (lambda k: k("c", "", k.COUNTER).Metric(labels={"a": 1}), "must be a string"),
        (lambda k: k("c", "", k.COUNTER).Metric(labels={"a": "x" * 257}), "at most 256"),
        # (each label adds to every report: a series' labels are bounded, as its values)
        (
            lambda k: k("c", "", k.COUNTER).Metric(labels={f"l{i}": "v" for i in range(17)}),
            "at most 16 labels",
        ),
        (lambda k: k("c", "d" * 1025, k.COUNTER), "longer than 1024 characters"),
        (lambda k: k("c", "", k.COUNTER).Metric(buckets=[1]), "only a histogram has buckets"),
        (lambda k: k("h", "", k.HISTOGRAM).Metric(), "needs buckets"),
        (lambda k: k("h", "", k.HISTOGRAM).Metric(buckets=[2, 1]), "increasing"),
        (lambda k: k("h", "", k.HISTOGRAM).Metric(buckets=[]), "1 to 64 buckets"),
        (lambda k: k("h", "", k.HISTOGRAM).Metric(buckets=[1]).value(), "no single value"),
    ],
)
def test_what_a_model_cannot_ask_for_raises_tritons_exception(make: object, text: str) -> None:
    with pytest.raises(pb_utils.TritonModelException, match=text):
        make(pb_utils.MetricFamily)  # type: ignore[operator]


def test_a_family_name_keeps_its_kind_and_description() -> None:
    kinds = pb_utils.MetricFamily
    kinds("x", "One", kinds.COUNTER)
    with pytest.raises(pb_utils.TritonModelException, match="another kind or description"):
        kinds("x", "One", kinds.GAUGE)
    with pytest.raises(pb_utils.TritonModelException, match="another kind or description"):
        kinds("x", "Two", kinds.COUNTER)


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
    assert lines == ["# HELP x X", "# TYPE x gauge", 'x{a="b"} 1', "# HELP y X", "# TYPE y gauge"]


def test_unreadable_reports_are_left_out() -> None:
    live = cm.encode_report(_report("counter", [_series(1)]))  # type: ignore[arg-type]
    raw = [live, b"{not json", json.dumps({}).encode(), json.dumps({"families": 3}).encode()]
    assert len(cm.decode_reports(raw)) == 1
