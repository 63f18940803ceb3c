"""h2load (nghttp2's load generator, Debian package ``nghttp2-client``) at fixed arrival rates.

``h2load --h1 --rps R`` makes every client (one keep-alive connection each) send R
requests/s; with a request body a client has at most one request in flight. To spread
the arrivals of all clients evenly, the clients are started ``period`` apart
(``-r 1 --rate-period``): with ``clients`` clients at ``rate / clients`` requests/s each,
client ``i`` sends at ``i * period`` modulo the per-client interval, and those offsets are
evenly spaced when ``period * rate`` is a whole number coprime with ``clients``.
h2load reads its periods in whole milliseconds, so :func:`arrival_plan` picks the shortest
such period (the bench warns when no period up to ``MAX_PERIOD_MS`` fits).

h2load prints only min/mean/max of the request time; the percentiles come from its
``--log-file`` (one row per request: start in microseconds since the epoch, status or -1,
microseconds until the end of the response). Latency runs from the actual send, so a
client still waiting for its previous answer delays its next request: each client is given
at least ``CLIENT_INTERVAL_S`` between its requests to keep that rare.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

from bench.http_request import RequestParts

CLIENT_INTERVAL_S = 0.02  # the least time between two requests of one client
MAX_PERIOD_MS = 50


@dataclass(frozen=True)
class ArrivalPlan:
    clients: int
    period_ms: int  # between two client starts
    per_client_rate: float
    even: bool  # arrivals evenly spaced

    @property
    def ramp_s(self) -> float:
        return self.clients * self.period_ms / 1000.0


def arrival_plan(rate: float, min_clients: int = 0) -> ArrivalPlan:
    """Clients and start period for ``rate`` requests/s with evenly spaced arrivals."""
    least = max(1, min_clients, math.ceil(rate * CLIENT_INTERVAL_S))
    for period_ms in range(1, MAX_PERIOD_MS + 1):
        step = rate * period_ms / 1000.0  # period in units of 1/rate
        if abs(step - round(step)) > 1e-9 or round(step) < 1:
            continue
        clients = least
        while math.gcd(clients, round(step)) != 1:
            clients += 1
        return ArrivalPlan(clients, period_ms, rate / clients, even=True)
    return ArrivalPlan(least, 1, rate / least, even=False)


def command(
    executable: str,
    url: str,
    request: RequestParts,
    body_path: Path,
    plan: ArrivalPlan,
    requests: int,
    log_path: Path,
) -> list[str]:
    """h2load's command line: ``requests`` requests over HTTP/1.1 at ``plan``'s rate."""
    headers = [f"--header={name}: {value}" for name, value in request.headers.items()]
    return [
        executable,
        "--h1",
        f"--clients={plan.clients}",
        f"--rps={plan.per_client_rate:.6f}",
        "--rate=1",
        f"--rate-period={plan.period_ms}ms",
        f"--requests={max(requests, plan.clients)}",
        f"--data={body_path}",
        f"--log-file={log_path}",
        *headers,
        url.rstrip("/") + request.path,
    ]


@dataclass(frozen=True)
class H2loadResult:
    """h2load's text summary, and the latencies of its log file."""

    elapsed_s: float
    requests_per_s: float  # h2load's figure (from the first connection to the end)
    total: int
    succeeded: int  # 2xx and 3xx
    failed: int
    errored: int
    timeout: int
    status_counts: dict[str, int]  # 2xx, 3xx, 4xx, 5xx
    request_time_ms: dict[str, float]  # min, max, mean, sd ("time for request")
    latencies_s: list[float]  # successful requests, from the log file
    log_span_s: float  # first start to last end in the log

    @property
    def errors(self) -> int:
        return self.total - self.succeeded


_FINISHED = re.compile(r"^finished in ([\d.]+)(us|ms|s), ([\d.]+) req/s", re.MULTILINE)
_REQUESTS = re.compile(
    r"^requests: (\d+) total, \d+ started, \d+ done, (\d+) succeeded, (\d+) failed, "
    r"(\d+) errored, (\d+) timeout",
    re.MULTILINE,
)
_STATUS = re.compile(r"^status codes: (\d+) 2xx, (\d+) 3xx, (\d+) 4xx, (\d+) 5xx", re.MULTILINE)
_REQUEST_TIME = re.compile(r"^time for request:\s+(\S+)\s+(\S+)\s+(\S+)\s+(\S+)", re.MULTILINE)
_UNIT_SECONDS = {"us": 1e-6, "ms": 1e-3, "s": 1.0}


def duration_seconds(text: str) -> float:
    """h2load's ``1.86ms`` / ``752us`` / ``2.00s`` in seconds."""
    match = re.fullmatch(r"([\d.]+)(us|ms|s)", text)
    if match is None:
        raise ValueError(f"not an h2load duration: {text!r}")
    return float(match.group(1)) * _UNIT_SECONDS[match.group(2)]


def parse_log(text: str) -> tuple[list[float], float]:
    """Latencies (seconds) of the 2xx/3xx rows of a ``--log-file``, and the log's span."""
    latencies: list[float] = []
    first_start, last_end = math.inf, -math.inf
    for line in text.splitlines():
        fields = line.split("\t")
        if len(fields) < 3:
            continue
        start_us, status, took_us = int(fields[0]), int(fields[1]), int(fields[2])
        first_start = min(first_start, start_us)
        last_end = max(last_end, start_us + took_us)
        if 200 <= status < 400:
            latencies.append(took_us / 1e6)
    span = (last_end - first_start) / 1e6 if latencies or last_end > first_start else 0.0
    return latencies, max(span, 0.0)


def parse_output(text: str, log_text: str = "") -> H2loadResult:
    """Parse h2load's stdout and (for the percentiles) its ``--log-file``."""
    finished, requests = _FINISHED.search(text), _REQUESTS.search(text)
    status, request_time = _STATUS.search(text), _REQUEST_TIME.search(text)
    if finished is None or requests is None or status is None:
        raise ValueError(f"h2load's output has no summary:\n{text[-2000:]}")
    elapsed = float(finished.group(1)) * _UNIT_SECONDS[finished.group(2)]
    times: dict[str, float] = {}
    if request_time is not None:
        names = ("min", "max", "mean", "sd")
        times = {
            n: duration_seconds(v) * 1000.0
            for n, v in zip(names, request_time.groups(), strict=True)
        }
    latencies, span = parse_log(log_text)
    total, succeeded, failed, errored, timeout = (int(g) for g in requests.groups())
    return H2loadResult(
        elapsed_s=elapsed,
        requests_per_s=float(finished.group(3)),
        total=total,
        succeeded=succeeded,
        failed=failed,
        errored=errored,
        timeout=timeout,
        status_counts=dict(
            zip(("2xx", "3xx", "4xx", "5xx"), map(int, status.groups()), strict=True)
        ),
        request_time_ms=times,
        latencies_s=latencies,
        log_span_s=span,
    )
