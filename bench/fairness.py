"""Fair share between tenants on the CNN: a flooding tenant next to a light one, and two
saturating tenants weighted 3:1.

``python -m bench.fairness`` serves a repository holding only the cnn model (one instance)
with two API keys (tenants ``a`` and ``b``), first measures what the instance answers
(closed loop, tenant a), then:

1. B alone: an open loop at 20 % of that capacity; B's p99 and answered rate.
2. A at 10x the capacity (open loop) and B at 20 % together: B's p99 (the objective: within
   1.5x of B alone) and B's answered rate (within 5 % of what it asked). A's refusals
   (429/503) are counted, not hidden.
3. Weights 3:1 (a limits file, ``weight = 3`` for a), both tenants saturating (closed loops):
   the split of the requests answered (the objective: 3:1 within 10 %).

Latency is counted from each request's scheduled time, by the client; "in the queue" is the
server's view (``sluice_tenant_queue_duration_seconds``: enqueue to the batch's start, as a
histogram bucket bound). Prints one Markdown table. A short smoke run:
``python -m bench.fairness --seconds 5``; run it on a host with cores to spare for the
load generator and the gateway, or the client's figures measure them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import re
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Coroutine
from pathlib import Path
from time import perf_counter
from typing import Any

from bench import loadgen
from bench.client import Target, model_path
from bench.loadgen import Trace
from bench.payload import build_request
from bench.stack import cnn_repository, start_stack, stop_stack

KEYS = {"a": "bench-key-of-a", "b": "bench-key-of-b"}
ITEMS_PER_REQUEST = 8


def with_key(raw: bytes, tenant: str) -> bytes:
    """The encoded request with the tenant's API key."""
    head, _, rest = raw.partition(b"\r\n")
    return head + f"\r\nAuthorization: Bearer {KEYS[tenant]}\r\n".encode() + rest


async def open_loop(target: Target, raw: bytes, rate: float, seconds: float) -> Trace:
    """``rate`` requests per second for ``seconds`` (see :func:`loadgen.open_loop_phases`)."""
    return await loadgen.open_loop_phases(target, raw, [(seconds, rate)])


async def together(*loads: Coroutine[Any, Any, object]) -> list[object]:
    """The loads at once (on the one event loop ``loadgen.run`` starts)."""
    return list(await asyncio.gather(*loads))


def p99(values: list[float]) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]


_TENANT_QUEUE_BUCKET = re.compile(r"sluice_tenant_queue_duration_seconds_bucket\{([^}]*)\} (\S+)")


def queue_buckets(target: Target, tenant: str) -> dict[float, float]:
    """A tenant's cumulative queue time buckets (upper bound s -> requests) from /metrics."""
    _, body = authorized_get(target, "/metrics")
    buckets: dict[float, float] = {}
    for line in body.decode(errors="replace").splitlines():
        match = _TENANT_QUEUE_BUCKET.fullmatch(line)
        if not match or f'tenant="{tenant}"' not in match.group(1):
            continue
        bound = re.search(r'le="([^"]+)"', match.group(1))
        if bound is not None:
            le = float(bound.group(1))
            buckets[le] = buckets.get(le, 0.0) + float(match.group(2))
    return buckets


def queue_p99_bound_s(before: dict[float, float], after: dict[float, float]) -> float:
    """The bucket bound under which 99 % of the requests between the two looks waited."""
    counts = {le: after[le] - before.get(le, 0.0) for le in sorted(after)}
    total = counts.get(math.inf, 0.0)
    for le, count in counts.items():
        if total and count >= 0.99 * total:
            return le
    return math.nan


def environment(limits: Path | None) -> dict[str, str]:
    env = {"SLUICE_API_KEYS": ",".join(f"{t}:{k}" for t, k in KEYS.items())}
    if limits is not None:
        env["SLUICE_TENANT_LIMITS_FILE"] = str(limits)
    return env


def authorized_get(target: Target, path: str) -> tuple[int, bytes]:
    """``GET path`` with tenant a's key (the routes ask for one once keys are set)."""
    request = urllib.request.Request(
        target.url + path, headers={"Authorization": f"Bearer {KEYS['a']}"}
    )
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(request, timeout=5) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except OSError:
        return 0, b""


def requests(target: Target) -> dict[str, bytes]:
    deadline = perf_counter() + 120
    while authorized_get(target, model_path("cnn", "/ready"))[0] != 200:
        if perf_counter() > deadline:
            raise TimeoutError("the cnn model did not become ready")
        time.sleep(0.2)
    status, body = authorized_get(target, model_path("cnn"))
    assert status == 200, body
    metadata = json.loads(body)
    raw = build_request(target, "cnn", metadata, 32, "binary", batch=ITEMS_PER_REQUEST).raw
    return {tenant: with_key(raw, tenant) for tenant in KEYS}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-repository", type=Path, default=Path("model_repository"))
    parser.add_argument("--seconds", type=float, default=30.0, help="length of each phase")
    args = parser.parse_args()
    rows: list[str] = []
    with tempfile.TemporaryDirectory(prefix="sluice-fairness-") as scratch:
        root = cnn_repository(args.model_repository, Path(scratch) / "repository")
        stack = start_stack(root, env=environment(None))
        try:
            target = Target("127.0.0.1", stack.port)
            raw = requests(target)
            loadgen.run(loadgen.closed_loop(target, raw["a"], 8, 2.0))  # (warm up)
            result = loadgen.run(loadgen.closed_loop(target, raw["a"], 8, min(args.seconds, 10)))
            capacity = len(result.latencies) / result.elapsed
            print(f"one instance answers {capacity:.1f} requests/s", flush=True)
            light = 0.2 * capacity
            start_alone = queue_buckets(target, "b")
            alone = loadgen.run(open_loop(target, raw["b"], light, args.seconds))
            start_shared = queue_buckets(target, "b")
            flood, shared = loadgen.run(
                together(
                    open_loop(target, raw["a"], 10 * capacity, args.seconds),
                    open_loop(target, raw["b"], light, args.seconds),
                )
            )
            end_shared = queue_buckets(target, "b")
        finally:
            stop_stack(stack)
        assert isinstance(flood, Trace) and isinstance(shared, Trace)
        asked = len(shared.sent)
        rows.append(
            f"| B alone at 20 % | p99 {p99(alone.answered()) * 1000:.0f} ms | "
            f"{len(alone.answered())} of {len(alone.sent)} answered; p99 in the queue "
            f"<= {queue_p99_bound_s(start_alone, start_shared) * 1000:g} ms |"
        )
        ratio = p99(shared.answered()) / p99(alone.answered())
        rows.append(
            f"| B at 20 %, A at 10x | p99 {p99(shared.answered()) * 1000:.0f} ms "
            f"({ratio:.2f}x alone; objective <= 1.5x) | "
            f"{len(shared.answered())} of {asked} answered "
            f"({len(shared.answered()) / max(asked, 1):.1%}; objective >= 95 %); "
            f"A: {len(flood.answered())} answered, {flood.refused()} refused; B's p99 in the "
            f"queue <= {queue_p99_bound_s(start_shared, end_shared) * 1000:g} ms |"
        )

        limits = Path(scratch) / "limits.toml"
        limits.write_text("[tenants.a]\nweight = 3\n\n[tenants.b]\nweight = 1\n")
        stack = start_stack(root, env=environment(limits))
        try:
            target = Target("127.0.0.1", stack.port)
            raw = requests(target)
            heavy, other = loadgen.run(
                together(
                    loadgen.closed_loop(target, raw["a"], 16, args.seconds),
                    loadgen.closed_loop(target, raw["b"], 16, args.seconds),
                )
            )
        finally:
            stop_stack(stack)
        assert isinstance(heavy, loadgen.LoadResult) and isinstance(other, loadgen.LoadResult)
        done_a, done_b = len(heavy.latencies), len(other.latencies)
        split = done_a / max(done_b, 1)
        rows.append(
            f"| weights 3:1, both saturating | A {done_a}, B {done_b} answered | "
            f"split {split:.2f}:1 (objective 3:1 within 10 %) |"
        )
    print()
    print(f"cnn, one instance, {ITEMS_PER_REQUEST} items a request, {args.seconds:g} s a phase")
    print()
    print("| case | latency / answered | figure |")
    print("| --- | --- | --- |")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
