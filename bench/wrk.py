"""wrk (the C HTTP/1.1 load generator, Debian package ``wrk``) for saturation points.

wrk keeps ``connections`` keep-alive connections busy back to back for a duration. The
bench writes a Lua script that POSTs one pre-encoded inference request (its body read
from a file next to the script, so binary tensors pass untouched) and whose ``done()``
hook prints one line, ``wrk-summary {json}``, with the counts and the latency percentiles
(in microseconds) that wrk's own text summary rounds or leaves out.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from bench.http_request import RequestParts

SUMMARY_PREFIX = "wrk-summary "
PERCENTILES = (50.0, 90.0, 99.0, 99.9)

_DONE_HOOK = """
function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    '%s{"duration_us": %d, "requests": %d, "bytes": %d, '
      .. '"errors": {"connect": %d, "read": %d, "write": %d, "status": %d, "timeout": %d}, '
      .. '"latency_us": {"min": %d, "mean": %.3f, "max": %d, "stdev": %.3f, '
      .. '"p50": %d, "p90": %d, "p99": %d, "p99.9": %d}}\\n',
    PREFIX, summary.duration, summary.requests, summary.bytes,
    e.connect, e.read, e.write, e.status, e.timeout,
    latency.min, latency.mean, latency.max, latency.stdev,
    latency:percentile(50), latency:percentile(90), latency:percentile(99),
    latency:percentile(99.9)))
end
"""


def lua_string(text: str | bytes) -> str:
    """A Lua string literal of any bytes (printable ASCII kept, the rest as ``\\ddd``)."""
    data = text.encode() if isinstance(text, str) else text
    out = []
    for byte in data:
        char = chr(byte)
        if char in '"\\':
            out.append("\\" + char)
        elif 32 <= byte < 127:
            out.append(char)
        else:
            out.append(f"\\{byte:03d}")
    return '"' + "".join(out) + '"'


def lua_script(request: RequestParts, body_path: Path) -> str:
    """The script that makes wrk send ``request`` (its body read from ``body_path``)."""
    lines = [
        "-- Written by python -m bench: POST one pre-encoded inference request.",
        f"wrk.method = {lua_string(request.method)}",
        f"wrk.path = {lua_string(request.path)}",
        f"local file = assert(io.open({lua_string(str(body_path))}, 'rb'))",
        "wrk.body = file:read('*a')",
        "file:close()",
    ]
    lines += [
        f"wrk.headers[{lua_string(name)}] = {lua_string(value)}"
        for name, value in request.headers.items()
    ]
    lines.append(f"PREFIX = {lua_string(SUMMARY_PREFIX)}")
    return "\n".join(lines) + "\n" + _DONE_HOOK


def write_script(folder: Path, request: RequestParts) -> Path:
    """Write the body and the Lua script into ``folder``; returns the script's path."""
    body_path = folder / "body.bin"
    body_path.write_bytes(request.body)
    script = folder / "request.lua"
    script.write_text(lua_script(request, body_path.resolve()))
    return script


def command(
    executable: str, url: str, script: Path, connections: int, seconds: float, threads: int
) -> list[str]:
    """wrk's command line; ``threads`` is capped at ``connections`` as wrk demands."""
    return [
        executable,
        "--latency",
        f"--threads={max(1, min(threads, connections))}",
        f"--connections={connections}",
        f"--duration={max(1, round(seconds))}s",
        "--timeout=10s",
        f"--script={script}",
        url,
    ]


@dataclass(frozen=True)
class WrkResult:
    """What one wrk run reports."""

    requests: int  # completed responses, whatever their status
    duration_s: float
    requests_per_s: float  # wrk's own figure
    non_2xx: int  # "Non-2xx or 3xx responses"
    socket_errors: dict[str, int]  # connect, read, write, timeout
    latency_ms: dict[str, float]  # min, mean, max, stdev, p50, p90, p99, p99.9

    @property
    def errors(self) -> int:
        return self.non_2xx + sum(self.socket_errors.values())

    @property
    def ok(self) -> int:
        return max(0, self.requests - self.non_2xx)


_REQUESTS_PER_S = re.compile(r"^Requests/sec:\s*([\d.]+)", re.MULTILINE)
_NON_2XX = re.compile(r"^\s*Non-2xx or 3xx responses:\s*(\d+)", re.MULTILINE)


def parse_output(text: str) -> WrkResult:
    """Parse wrk's stdout (its text summary and the ``done()`` hook's line)."""
    line = next((x for x in text.splitlines() if x.startswith(SUMMARY_PREFIX)), None)
    if line is None:
        raise ValueError(f"no {SUMMARY_PREFIX.strip()!r} line in wrk's output:\n{text[-2000:]}")
    summary = json.loads(line.removeprefix(SUMMARY_PREFIX))
    duration_s = summary["duration_us"] / 1e6
    rate = _REQUESTS_PER_S.search(text)
    non_2xx = _NON_2XX.search(text)
    errors = {k: int(v) for k, v in summary["errors"].items() if k != "status"}
    return WrkResult(
        requests=int(summary["requests"]),
        duration_s=duration_s,
        requests_per_s=(
            float(rate.group(1)) if rate else summary["requests"] / max(duration_s, 1e-9)
        ),
        non_2xx=int(non_2xx.group(1)) if non_2xx else int(summary["errors"]["status"]),
        socket_errors=errors,
        latency_ms={key: float(value) / 1000.0 for key, value in summary["latency_us"].items()},
    )
