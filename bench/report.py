"""Bench results: per-point summaries, Markdown tables, results.json and PNG plots."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.baseline import Baseline
from bench.cpu import GROUPS
from bench.loadgen import LoadResult, percentiles_ms

PERCENTILES = (50.0, 90.0, 99.0, 99.9)


@dataclass
class Point:
    """One load point, summarised."""

    loop: str  # "closed" or "open"
    mode: str  # "binary" or "json"
    concurrency: int | None  # closed loop
    rate: float | None  # open loop: offered requests/s
    duration_s: float
    requests: int  # successful requests counted
    errors: int
    dropped: int
    requests_per_s: float
    items_per_s: float
    p50_ms: float | None
    p90_ms: float | None
    p99_ms: float | None
    p999_ms: float | None
    error_samples: list[str] = field(default_factory=list)
    cpu_ms_per_request: dict[str, float] | None = None  # per group, plus "stack"
    fraction_of_inprocess: float | None = None  # items/s over the in-process best
    loadgen: str = "python"  # python (the bench's own clients), wrk or h2load

    @property
    def load(self) -> str:
        return f"c={self.concurrency}" if self.loop == "closed" else f"{self.rate:g}/s"


def cpu_per_request(cpu_seconds: dict[str, float] | None, requests: int) -> dict[str, float] | None:
    """CPU milliseconds per request of each role, plus their sum as ``stack`` (the load
    generator's own ``loadgen`` left out of it); None without a measurement or requests."""
    if cpu_seconds is None or not cpu_seconds or requests <= 0:
        return None
    cpu_ms = {group: seconds * 1000.0 / requests for group, seconds in cpu_seconds.items()}
    cpu_ms["stack"] = sum(value for group, value in cpu_ms.items() if group != "loadgen")
    return cpu_ms


def summarize(
    loop: str,
    mode: str,
    load: float,
    result: LoadResult,
    items_per_request: int,
    cpu_seconds: dict[str, float] | None,
    baseline: Baseline | None,
) -> Point:
    ok = len(result.latencies)
    requests_per_s = ok / result.elapsed if result.elapsed > 0 else 0.0
    items_per_s = requests_per_s * items_per_request
    p50, p90, p99, p999 = percentiles_ms(result.latencies, PERCENTILES)
    cpu_ms = cpu_per_request(cpu_seconds, ok + result.errors)
    return Point(
        loop=loop,
        mode=mode,
        concurrency=int(load) if loop == "closed" else None,
        rate=float(load) if loop == "open" else None,
        duration_s=result.elapsed,
        requests=ok,
        errors=result.errors,
        dropped=result.dropped,
        requests_per_s=requests_per_s,
        items_per_s=items_per_s,
        p50_ms=p50,
        p90_ms=p90,
        p99_ms=p99,
        p999_ms=p999,
        error_samples=result.error_samples,
        cpu_ms_per_request=cpu_ms,
        fraction_of_inprocess=items_per_s / baseline.best.items_per_s if baseline else None,
    )


@dataclass
class Results:
    meta: dict[str, Any]
    baseline: Baseline | None
    points: list[Point]

    def summary(self) -> dict[str, Any]:
        """Serving overhead per mode: best served items/s against in-process, latency at c=1."""
        summary: dict[str, Any] = {}
        for mode in dict.fromkeys(point.mode for point in self.points):
            closed = [p for p in self.points if p.loop == "closed" and p.mode == mode]
            if not closed:
                continue
            best = max(closed, key=lambda point: point.items_per_s)
            entry: dict[str, Any] = {
                "best_items_per_s": best.items_per_s,
                "best_concurrency": best.concurrency,
                "ratio_to_inprocess": best.fraction_of_inprocess,
            }
            single = next((p for p in closed if p.concurrency == 1), None)
            if single is not None and single.p50_ms is not None:
                entry["p50_ms_at_c1"] = single.p50_ms
                if self.baseline is not None:
                    entry["latency_overhead_ms_at_c1"] = single.p50_ms - self.baseline.batch1_p50_ms
            summary[mode] = entry
        return summary

    def to_json(self) -> dict[str, Any]:
        baseline = None
        if self.baseline is not None:
            baseline = dataclasses.asdict(self.baseline)
            baseline["best_items_per_s"] = self.baseline.best.items_per_s
            baseline["best_batch"] = self.baseline.best.batch
            baseline["batch1_p50_ms"] = self.baseline.batch1_p50_ms
        return {
            "meta": self.meta,
            "baseline": baseline,
            "points": [dataclasses.asdict(point) for point in self.points],
            "summary": self.summary(),
        }


# ----------------------------------------------------------------------------- Markdown


def _number(value: float | None, digits: int = 2) -> str:
    if value is None:
        return "-"
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    return f"{value:.{digits}f}"


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def baseline_markdown(baseline: Baseline) -> str:
    rows = [
        [str(p.batch), _number(p.p50_ms, 3), _number(p.items_per_s, 0)] for p in baseline.points
    ]
    best = baseline.best
    return (
        f"In-process {baseline.engine}, {baseline.model_path} ({baseline.threads} intra-op "
        f"thread(s)); best "
        f"**{_number(best.items_per_s, 0)} items/s** at batch {best.batch}; "
        f"batch-1 p50 {_number(baseline.batch1_p50_ms, 3)} ms.\n\n"
        + _table(["batch", "p50 ms", "items/s"], rows)
        + "".join(
            f"\n\nAt {_number(p.rate, 0)} batch-1 runs/s, evenly spaced: "
            f"{_number(p.cpu_us_per_run, 0)} us of CPU per run, p50 {_number(p.p50_ms, 3)} ms."
            for p in baseline.paced
        )
    )


def points_markdown(points: list[Point]) -> str:
    header = ["loop", "mode", "load", "req/s", "items/s", "p50 ms", "p90 ms", "p99 ms"]
    header += ["p99.9 ms", "errors", "of in-process", "CPU ms/req gw / wk / redis / other / lg"]
    rows = []
    for p in points:
        cpu = "-"
        if p.cpu_ms_per_request is not None:
            cpu = " / ".join(_number(p.cpu_ms_per_request[group], 3) for group in GROUPS)
        errors = str(p.errors) + (f" (+{p.dropped} dropped)" if p.dropped else "")
        fraction = "-"
        if p.fraction_of_inprocess is not None:
            fraction = f"{p.fraction_of_inprocess * 100:.3g}%"
        rows.append(
            [
                p.loop,
                p.mode,
                p.load,
                _number(p.requests_per_s, 0),
                _number(p.items_per_s, 0),
                _number(p.p50_ms),
                _number(p.p90_ms),
                _number(p.p99_ms),
                _number(p.p999_ms),
                errors,
                fraction,
                cpu,
            ]
        )
    return _table(header, rows)


def summary_markdown(results: Results) -> str:
    lines = []
    for mode, entry in results.summary().items():
        line = (
            f"- **{mode}**: best {_number(entry['best_items_per_s'], 0)} items/s "
            f"(closed loop, c={entry['best_concurrency']})"
        )
        if entry.get("ratio_to_inprocess") is not None:
            line += f" = {entry['ratio_to_inprocess']:.3g}x the in-process best"
        if "p50_ms_at_c1" in entry:
            line += f"; p50 at c=1 {_number(entry['p50_ms_at_c1'], 3)} ms"
        if "latency_overhead_ms_at_c1" in entry:
            line += (
                f" ({_number(entry['latency_overhead_ms_at_c1'], 3)} ms over in-process batch 1)"
            )
        lines.append(line + ".")
    return "\n".join(lines)


def markdown(results: Results) -> str:
    meta = results.meta
    parts = [
        f"### {meta['model']} ({', '.join(meta['modes'])}; {meta['duration_s']:g} s per point, "
        f"{meta['warmup_s']:g} s warm-up; {meta['cpu_count']} CPUs; "
        f"load generator {meta.get('loadgen', 'python')})",
    ]
    if meta.get("loadgen") == "h2load":
        parts.append(
            "h2load sends at fixed rates with evenly spaced arrivals; its latency runs from "
            "the actual send (a client waiting for its previous answer sends late)."
        )
    idle = meta.get("idle_cpu_percent")
    if idle:
        parts.append(
            f"Idle stack CPU over {meta.get('idle_seconds', 1.0):g} s with no request "
            "(% of one core; processes: "
            + ", ".join(f"{g} {n}" for g, n in meta["processes"].items() if g != "loadgen")
            + "): "
            + ", ".join(f"{group} {value:.1f}%" for group, value in idle.items())
            + f"; total {sum(idle.values()):.1f}%"
        )
    if results.baseline is not None:
        parts.append(baseline_markdown(results.baseline))
    if results.points:
        parts.append(points_markdown(results.points))
    summary = summary_markdown(results)
    if summary:
        parts.append("Serving overhead:\n\n" + summary)
    errors = [(p, sample) for p in results.points for sample in p.error_samples[:2]]
    if errors:
        parts.append(
            "First errors:\n\n"
            + "\n".join(f"- {p.loop} {p.mode} {p.load}: `{sample}`" for p, sample in errors)
        )
    return "\n\n".join(parts) + "\n"


# ----------------------------------------------------------------------------- files


def write_json(path: Path, results: Results) -> None:
    path.write_text(json.dumps(results.to_json(), indent=2) + "\n")


def _series(points: list[Point], loop: str) -> dict[str, list[Point]]:
    series: dict[str, list[Point]] = {}
    for point in points:
        if point.loop == loop:
            series.setdefault(point.mode, []).append(point)
    return series


def _loads(points: list[Point]) -> list[float]:
    """The x value of each point: concurrency (closed loop) or offered rate (open loop)."""
    return [float(p.concurrency or 0) if p.loop == "closed" else p.rate or 0.0 for p in points]


def plot_throughput(path: Path, results: Results) -> None:
    """items/s against concurrency (and against offered rate for open loop points)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    closed, opened = _series(results.points, "closed"), _series(results.points, "open")
    panels = [panel for panel in (closed, opened) if panel] or [closed]
    figure, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.5), squeeze=False)
    for axis, panel in zip(axes[0], panels, strict=True):
        is_closed = panel is closed
        for mode, points in panel.items():
            items = [p.items_per_s for p in points]
            axis.plot(_loads(points), items, marker="o", label=f"served ({mode})")
        if results.baseline is not None:
            best = results.baseline.best
            axis.axhline(
                best.items_per_s,
                color="grey",
                linestyle="--",
                label=f"in-process best (batch {best.batch})",
            )
            axis.set_yscale("log")
        axis.set_xscale("log", base=2 if is_closed else 10)
        ticks = sorted({x for points in panel.values() for x in _loads(points)})
        axis.set_xticks(ticks, [f"{x:g}" for x in ticks])
        axis.minorticks_off()
        axis.set_xlabel("concurrency (closed loop)" if is_closed else "offered requests/s")
        axis.set_ylabel("items/s")
        axis.grid(True, which="both", alpha=0.3)
        axis.legend()
    figure.suptitle(f"{results.meta['model']}: throughput")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def plot_latency(path: Path, results: Results) -> None:
    """p99 latency against achieved items/s, one line per loop and mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6.5, 4.5))
    for loop in ("closed", "open"):
        for mode, points in _series(results.points, loop).items():
            measured = [(p, p.p99_ms) for p in points if p.p99_ms is not None]
            (line,) = axis.plot(
                [p.items_per_s for p, _ in measured],
                [p99 for _, p99 in measured],
                marker="o" if loop == "closed" else "s",
                label=f"{loop} loop ({mode})",
            )
            for p, p99 in measured:
                axis.annotate(
                    p.load,
                    (p.items_per_s, p99),
                    textcoords="offset points",
                    xytext=(4, 4),
                    fontsize=7,
                    color=line.get_color(),
                )
    axis.set_xlabel("items/s")
    axis.set_ylabel("p99 latency (ms)")
    axis.set_yscale("log")
    axis.grid(True, which="both", alpha=0.3)
    if results.points:
        axis.legend()
    axis.set_title(f"{results.meta['model']}: p99 latency against throughput")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def write_all(out: Path, results: Results) -> str:
    """results.json, results.md, throughput.png, latency.png; returns the Markdown."""
    out.mkdir(parents=True, exist_ok=True)
    text = markdown(results)
    write_json(out / "results.json", results)
    (out / "results.md").write_text(text)
    plot_throughput(out / "throughput.png", results)
    plot_latency(out / "latency.png", results)
    return text
