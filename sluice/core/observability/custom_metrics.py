"""Metrics a model defines itself (Triton's Python-backend custom metrics: counters, gauges and
histograms with labels of the model's choosing), from the model's code to ``GET /metrics``.

A worker process keeps its model's metrics in :data:`REGISTRY` (the Python model calls
``pb_utils.MetricFamily``, see :mod:`sluice.workers.backends.triton_python_backend_utils`);
its heartbeat writes a :meth:`Registry.snapshot` to the deployment's Redis, one field per
worker with its expiry; a gateway's scrape reads every live worker's and :func:`render`
writes them as one family each, in Prometheus' text format. Workers of one model (on every
host) that report a series with the same name and labels are one series: counters and
histograms add up, a gauge shows the value set last, as Triton's instances share one
metric in its single process.

Series leave when Triton's do: each ``MetricFamily`` object holds its family
(:class:`FamilyHold`), and the series made through it live as long as it does. Deleted, its
series leave the report (unless another object of the same family made the same series)
and the metrics made through it refuse every operation, with Triton's error; a family with
no series is not written (as Triton writes none). A worker that exits takes its report
back, and one that dies leaves it to expire (:mod:`sluice.workers.liveness`).

Bounds: :data:`MAX_FAMILIES` families and :data:`MAX_SERIES` series per worker,
:data:`MAX_LABELS` labels per series, :data:`MAX_LABEL_CHARS` per label value,
:data:`MAX_DESCRIPTION_CHARS` per description, :data:`MAX_BUCKETS` per histogram; beyond
them the model's call fails. A worker's report (and its share of ``/metrics``) is bounded so.
"""

from __future__ import annotations

import json
import math
import re
import threading
import time
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

Kind = Literal["counter", "gauge", "histogram"]

MAX_SERIES = 1000
MAX_LABELS = 16
MAX_LABEL_CHARS = 256
MAX_DESCRIPTION_CHARS = 1024
MAX_BUCKETS = 64
MAX_FAMILIES = 256

DELETED_FAMILY = (
    "Invalid metric operation as the corresponding 'MetricFamily' has been deleted. The "
    "'MetricFamily' object should be deleted AFTER its corresponding 'Metric' objects have "
    "been deleted."
)
"""Triton's error for an operation on a metric whose ``MetricFamily`` object is gone."""

RESERVED_PREFIXES = ("nv_", "sluice_")
"""The server's own families' prefixes (Triton's and Sluice's), which no model may take."""

_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]{0,199}")
_LABEL = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]{0,99}")


class MetricError(ValueError):
    """A metric the model asked for that cannot be (bad name, kind, labels, value)."""


@dataclass
class Series:
    """One metric: a family's series with one set of labels."""

    labels: tuple[tuple[str, str], ...]
    value: float = 0.0
    set_at: float = 0.0
    """When a gauge was last set (unix seconds): the last set wins across workers."""
    buckets: tuple[float, ...] = ()
    counts: list[int] = field(default_factory=list)
    """A histogram's observations per bucket (not cumulative), the last past every bound."""
    total: float = 0.0
    observations: int = 0
    holds: int = 0
    """The family holds that made this series: it is reported while one is left."""


@dataclass
class Family:
    name: str
    description: str
    kind: Kind
    series: dict[tuple[tuple[str, str], ...], Series] = field(default_factory=dict)
    holds: int = 0
    """The ``MetricFamily`` objects that hold it: it is reported while one is left."""


class Registry:
    """The custom metrics of one process; safe to use from any thread."""

    def __init__(self) -> None:
        self._families: dict[str, Family] = {}
        self._count = 0
        self._lock = threading.Lock()
        self._released: deque[FamilyHold] = deque()
        """Holds released and not yet settled. A release comes from a ``__del__``, which
        may run on any thread at any allocation, this registry's own under its lock
        included: it only queues, and the next use of the registry settles it."""

    def hold(self, name: str, description: str, kind: Kind) -> FamilyHold:
        """A hold on the family ``name`` (made on first use; the same one again for the same
        description and kind while any hold on it is left)."""
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise MetricError(f"invalid metric family name {name!r}")
        if name.startswith(RESERVED_PREFIXES):
            raise MetricError(
                f"metric family '{name}': names starting with nv_ or sluice_ are the server's"
            )
        if kind not in ("counter", "gauge", "histogram"):
            raise MetricError(f"invalid metric family kind {kind!r}")
        description = str(description)
        if len(description) > MAX_DESCRIPTION_CHARS:
            raise MetricError(
                f"metric family '{name}': the description is longer than "
                f"{MAX_DESCRIPTION_CHARS} characters"
            )
        with self._lock:
            self._settle()
            found = self._families.get(name)
            if found is not None:
                if (found.kind, found.description) != (kind, description):
                    raise MetricError(
                        f"metric family '{name}' exists with another kind or description"
                    )
            elif len(self._families) >= MAX_FAMILIES:
                raise MetricError(f"more than {MAX_FAMILIES} metric families")
            else:
                found = self._families[name] = Family(name, description, kind)
            found.holds += 1
            return FamilyHold(self, found)

    def series(
        self,
        hold: FamilyHold,
        labels: Mapping[str, str] | None,
        buckets: Sequence[float] | None = None,
    ) -> Series:
        """The series of ``hold``'s family with ``labels`` (a histogram's needs its
        ``buckets``), held by ``hold`` until it is released."""
        family = hold.family
        key = _labels(labels)
        if family.kind == "histogram":
            if buckets is None:
                raise MetricError(f"histogram '{family.name}' needs buckets")
            bounds = _buckets(buckets)
        elif buckets is not None:
            raise MetricError(f"only a histogram has buckets ('{family.name}' is a {family.kind})")
        else:
            bounds = ()
        with self._lock:
            self._settle()
            if hold.released:
                raise MetricError(DELETED_FAMILY)
            found = family.series.get(key)
            if found is not None:
                if found.buckets != bounds:
                    raise MetricError(f"'{family.name}' {dict(key)} exists with other buckets")
            elif self._count >= MAX_SERIES:
                raise MetricError(f"more than {MAX_SERIES} metrics in one model process")
            else:
                counts = [0] * (len(bounds) + 1) if bounds else []
                found = family.series[key] = Series(key, buckets=bounds, counts=counts)
                self._count += 1
            if key not in hold.series:
                hold.series[key] = found
                found.holds += 1
            return found

    def queue_release(self, hold: FamilyHold) -> None:
        """Settle ``hold``'s release at the next use (takes no lock: ``__del__`` calls it)."""
        self._released.append(hold)

    def _settle(self) -> None:
        """Apply the releases queued (under the lock): a series no hold is left on leaves
        its family, and a family no hold is left on leaves the registry."""
        while self._released:
            hold = self._released.popleft()
            family = hold.family
            for key, series in hold.series.items():
                series.holds -= 1
                if series.holds == 0 and family.series.get(key) is series:
                    del family.series[key]
                    self._count -= 1
            hold.series.clear()
            family.holds -= 1
            if family.holds == 0 and self._families.get(family.name) is family:
                del self._families[family.name]

    def increment(self, family: Family, series: Series, value: float) -> None:
        number = _number(value)
        if family.kind == "histogram":
            raise MetricError(f"'{family.name}' is a histogram: observe() it")
        if family.kind == "counter" and number < 0:
            raise MetricError(f"counter '{family.name}' cannot decrease ({number})")
        with self._lock:
            series.value += number
            series.set_at = time.time()

    def set(self, family: Family, series: Series, value: float) -> None:
        if family.kind != "gauge":
            raise MetricError(f"only a gauge is set ('{family.name}' is a {family.kind})")
        number = _number(value)
        with self._lock:
            series.value = number
            series.set_at = time.time()

    def observe(self, family: Family, series: Series, value: float) -> None:
        if family.kind != "histogram":
            raise MetricError(f"only a histogram observes ('{family.name}' is a {family.kind})")
        number = _number(value)
        with self._lock:
            index = next((i for i, bound in enumerate(series.buckets) if number <= bound), -1)
            series.counts[index] += 1
            series.total += number
            series.observations += 1

    def snapshot(self) -> list[dict[str, Any]]:
        """Every family and series, as :func:`render` reads them (JSON-ready)."""
        with self._lock:
            self._settle()
            return [
                {
                    "name": family.name,
                    "description": family.description,
                    "kind": family.kind,
                    "series": [
                        {
                            "labels": dict(series.labels),
                            "value": series.value,
                            "set_at": series.set_at,
                            "buckets": list(series.buckets),
                            "counts": list(series.counts),
                            "sum": series.total,
                            "count": series.observations,
                        }
                        for series in family.series.values()
                    ],
                }
                for family in self._families.values()
            ]

    def __bool__(self) -> bool:
        with self._lock:
            self._settle()
            return bool(self._families)


class FamilyHold:
    """One ``MetricFamily`` object's hold on its family, and on the series made through it
    (Triton's ``MetricFamily`` keeps its ``Metric`` objects, and deleting it deletes them).
    :meth:`release` when the object goes; the operations of a released hold's metrics
    raise :data:`DELETED_FAMILY`, as Triton's do."""

    def __init__(self, registry: Registry, family: Family) -> None:
        self.registry = registry
        self.family = family
        self.series: dict[tuple[tuple[str, str], ...], Series] = {}
        """The series made through this hold, each held once however often it was asked
        for."""
        self.released = False

    def metric(
        self, labels: Mapping[str, str] | None, buckets: Sequence[float] | None = None
    ) -> Series:
        """The series of the family with ``labels`` (a histogram's needs its ``buckets``),
        held until this hold is released."""
        return self.registry.series(self, labels, buckets)

    def increment(self, series: Series, value: float) -> None:
        self._check()
        self.registry.increment(self.family, series, value)

    def set(self, series: Series, value: float) -> None:
        self._check()
        self.registry.set(self.family, series, value)

    def observe(self, series: Series, value: float) -> None:
        self._check()
        self.registry.observe(self.family, series, value)

    def value(self, series: Series) -> float:
        self._check()
        return series.value

    def release(self) -> None:
        """Let the family and its series go (settled at the registry's next use; safe from
        ``__del__``, once or more)."""
        if not self.released:
            self.released = True
            self.registry.queue_release(self)

    def _check(self) -> None:
        if self.released:
            raise MetricError(DELETED_FAMILY)


REGISTRY = Registry()
"""This process's custom metrics (a worker serves one model)."""


def encode_report(families: list[dict[str, Any]]) -> bytes:
    """What a worker writes to Redis: its families. When the report stops counting is kept
    beside it (``Keys.custom_metrics_expiry``), so an unchanged report need not be written
    again to stay alive."""
    return json.dumps({"families": families}).encode()


def decode_reports(raw: Iterable[bytes]) -> list[Any]:
    """The families of each readable report (the reader leaves out expired ones)."""
    reports: list[Any] = []
    for text in raw:
        try:
            families = json.loads(text)["families"]
        except (ValueError, KeyError, TypeError, RecursionError):  # (nested past the stack)
            continue
        if isinstance(families, list):
            reports.append(families)
    return reports


def render(reports: Iterable[list[Any]]) -> list[str]:
    """The families of every worker's report, merged, in Prometheus' text format."""
    merged: dict[str, tuple[str, str, dict[tuple[tuple[str, str], ...], dict[str, Any]]]] = {}
    for families in reports:
        for family in families:
            try:
                name, kind = str(family["name"]), str(family["kind"])
                description = str(family["description"])
                series_list = list(family["series"])
            except (KeyError, TypeError):
                continue
            if not _NAME.fullmatch(name) or kind not in ("counter", "gauge", "histogram"):
                continue
            if name.startswith(RESERVED_PREFIXES):
                continue
            kept = merged.setdefault(name, (kind, description, {}))
            if kept[0] != kind:
                continue  # (another model's family of that name and another kind)
            for series in series_list:
                _merge(kind, kept[2], series)
    lines: list[str] = []
    for name, (kind, description, all_series) in sorted(merged.items()):
        if not all_series:
            continue  # (a family with no series is not written, as Triton writes none)
        lines += [f"# HELP {name} {_help(description)}", f"# TYPE {name} {kind}"]
        for labels, series in sorted(all_series.items()):
            lines += _series_lines(name, kind, labels, series)
    return lines


def _merge(kind: str, into: dict[tuple[tuple[str, str], ...], dict[str, Any]], series: Any) -> None:
    try:
        labels = tuple(sorted((str(k), str(v)) for k, v in dict(series["labels"]).items()))
        value, set_at = float(series["value"]), float(series["set_at"])
        buckets = [float(b) for b in series["buckets"]]
        counts = [int(c) for c in series["counts"]]
        total, count = float(series["sum"]), int(series["count"])
    except (KeyError, TypeError, ValueError, OverflowError):  # (an integer past a float's range)
        return
    if not all(_LABEL.fullmatch(name) for name, _ in labels):
        return
    known = into.get(labels)
    if known is None:
        into[labels] = {
            "value": value,
            "set_at": set_at,
            "buckets": buckets,
            "counts": counts,
            "sum": total,
            "count": count,
        }
    elif kind == "gauge":
        if set_at >= known["set_at"]:
            known["value"], known["set_at"] = value, set_at
    elif kind == "counter":
        known["value"] += value
    elif known["buckets"] == buckets and len(counts) == len(known["counts"]):
        known["counts"] = [a + b for a, b in zip(known["counts"], counts, strict=True)]
        known["sum"] += total
        known["count"] += count


def _series_lines(
    name: str, kind: str, labels: tuple[tuple[str, str], ...], series: dict[str, Any]
) -> list[str]:
    text = ",".join(f'{key}="{_escape(value)}"' for key, value in labels)
    if kind != "histogram":
        return [
            f"{name}{{{text}}} {_format(series['value'])}"
            if text
            else f"{name} {_format(series['value'])}"
        ]
    lines: list[str] = []
    cumulative = 0
    bounds = [*series["buckets"], math.inf]
    for bound, count in zip(bounds, series["counts"], strict=False):
        cumulative += count
        le = "+Inf" if math.isinf(bound) else _format(bound)
        joined = f'{text},le="{le}"' if text else f'le="{le}"'
        lines.append(f"{name}_bucket{{{joined}}} {cumulative}")
    suffix = f"{{{text}}}" if text else ""
    lines += [
        f"{name}_sum{suffix} {_format(series['sum'])}",
        f"{name}_count{suffix} {series['count']}",
    ]
    return lines


def _labels(labels: Mapping[str, str] | None) -> tuple[tuple[str, str], ...]:
    if labels is None:
        return ()
    if not isinstance(labels, Mapping):
        raise MetricError("labels must be a dict of strings")
    if len(labels) > MAX_LABELS:
        raise MetricError(f"a metric has at most {MAX_LABELS} labels, not {len(labels)}")
    pairs = []
    for key, value in labels.items():
        if not isinstance(key, str) or not _LABEL.fullmatch(key) or key == "le":
            raise MetricError(f"invalid label name {key!r}")
        if not isinstance(value, str) or len(value) > MAX_LABEL_CHARS:
            raise MetricError(f"label '{key}' must be a string of at most {MAX_LABEL_CHARS} chars")
        pairs.append((key, value))
    return tuple(sorted(pairs))


def _buckets(buckets: Sequence[float]) -> tuple[float, ...]:
    try:
        bounds = tuple(float(b) for b in buckets)
    except (TypeError, ValueError):
        raise MetricError("buckets must be numbers") from None
    if not bounds or len(bounds) > MAX_BUCKETS:
        raise MetricError(f"a histogram has 1 to {MAX_BUCKETS} buckets")
    if any(not math.isfinite(b) for b in bounds) or list(bounds) != sorted(set(bounds)):
        raise MetricError("buckets must be finite and increasing")
    return bounds


def _number(value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise MetricError(f"a metric's value is a number, not {type(value).__name__}")
    number = float(value)
    if not math.isfinite(number):
        raise MetricError(f"a metric's value must be finite ({number})")
    return number


def _format(value: float) -> str:
    return (
        str(int(value)) if float(value).is_integer() and abs(value) < 1e15 else repr(float(value))
    )


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")
