"""wrk's Lua script sends the bench's pre-encoded request, and its output parses."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from bench import wrk
from bench.client import Target, encode_request
from bench.http_request import split_request

FIXTURES = Path(__file__).parent / "fixtures"


def binary_request() -> bytes:
    header = b'{"inputs":[{"name":"x","shape":[1,2],"datatype":"FP32"}]}'
    body = header + bytes([0, 1, 2, 34, 92, 10, 13, 255])  # NUL, quote, backslash, CR, LF
    return encode_request(
        Target("127.0.0.1", 8000),
        "POST",
        "/v2/models/mlp/infer",
        body,
        {
            "Content-Type": "application/octet-stream",
            "Inference-Header-Content-Length": str(len(header)),
        },
    )


def test_split_request_keeps_the_body_and_drops_the_headers_wrk_writes() -> None:
    parts = split_request(binary_request())
    assert (parts.method, parts.path) == ("POST", "/v2/models/mlp/infer")
    assert parts.headers == {
        "Content-Type": "application/octet-stream",
        "Inference-Header-Content-Length": "57",
    }
    assert parts.body.endswith(bytes([0, 1, 2, 34, 92, 10, 13, 255]))
    assert len(parts.body) == 57 + 8


def test_lua_string_escapes_every_byte_that_is_not_printable() -> None:
    assert wrk.lua_string('a"b\\c') == '"a\\"b\\\\c"'
    assert wrk.lua_string(bytes([0, 10, 255])) == '"\\000\\010\\255"'


def test_script_reads_the_body_from_its_file_and_sets_the_headers(tmp_path: Path) -> None:
    parts = split_request(binary_request())
    script = wrk.write_script(tmp_path, parts)
    assert (tmp_path / "body.bin").read_bytes() == parts.body
    text = script.read_text()
    assert 'wrk.method = "POST"' in text
    assert 'wrk.path = "/v2/models/mlp/infer"' in text
    assert 'wrk.headers["Inference-Header-Content-Length"] = "57"' in text
    assert str((tmp_path / "body.bin").resolve()) in text
    assert "function done(summary, latency, requests)" in text


def test_script_runs_in_lua_and_the_done_hook_prints_the_parsed_line(tmp_path: Path) -> None:
    """Run the script under LuaJIT (wrk's Lua) with a stand-in ``wrk`` table (``make
    bootstrap`` installs LuaJIT, scripts/bench-tools.sh)."""
    assert shutil.which("luajit"), "luajit is missing: run scripts/bench-tools.sh as root"
    parts = split_request(binary_request())
    script = wrk.write_script(tmp_path, parts)
    harness = tmp_path / "harness.lua"
    harness.write_text(
        "wrk = {headers = {}}\n"
        f"dofile({wrk.lua_string(str(script))})\n"
        "assert(#wrk.body == %d)\n"
        % len(parts.body)
        + "local latency = {min = 100, mean = 250.5, max = 900, stdev = 20.25}\n"
        "function latency:percentile(p) return p * 10 end\n"
        "done({duration = 2000000, requests = 10, bytes = 999,\n"
        "      errors = {connect = 0, read = 1, write = 0, status = 2, timeout = 0}},\n"
        "     latency, nil)\n"
    )
    out = subprocess.run(
        ["luajit", str(harness)], capture_output=True, text=True, check=True
    ).stdout
    result = wrk.parse_output(out)
    assert result.requests == 10
    assert result.duration_s == 2.0
    assert result.non_2xx == 2
    assert result.socket_errors == {"connect": 0, "read": 1, "write": 0, "timeout": 0}
    assert result.latency_ms["p99.9"] == pytest.approx(0.999)
    assert result.latency_ms["mean"] == pytest.approx(0.2505)


def test_parses_a_real_wrk_run() -> None:
    result = wrk.parse_output((FIXTURES / "wrk_binary.txt").read_text())
    assert result.requests == 2577
    assert result.duration_s == pytest.approx(2.009158)
    assert result.requests_per_s == pytest.approx(1282.63)
    assert result.non_2xx == 0
    assert result.errors == 0
    assert result.ok == 2577
    assert result.latency_ms["p50"] == pytest.approx(5.478)
    assert result.latency_ms["p90"] == pytest.approx(10.976)
    assert result.latency_ms["p99"] == pytest.approx(22.426)
    assert result.latency_ms["p99.9"] == pytest.approx(27.782)


def test_parses_a_json_mode_run() -> None:
    result = wrk.parse_output((FIXTURES / "wrk_json.txt").read_text())
    assert result.requests == 2668
    assert result.requests_per_s == pytest.approx(1333.34)


def test_counts_non_2xx_answers_as_errors() -> None:
    result = wrk.parse_output((FIXTURES / "wrk_non2xx.txt").read_text())
    assert result.non_2xx == result.requests == 15166
    assert result.ok == 0
    assert result.errors == 15166


def test_output_without_the_done_line_is_refused() -> None:
    with pytest.raises(ValueError, match="wrk-summary"):
        wrk.parse_output("Running 2s test @ http://127.0.0.1:1\n")


def test_command_caps_threads_at_connections(tmp_path: Path) -> None:
    line = wrk.command("wrk", "http://127.0.0.1:8000", tmp_path / "s.lua", 2, 5.4, 4)
    assert "--threads=2" in line
    assert "--connections=2" in line
    assert "--duration=5s" in line
    assert "--latency" in line
    assert line[-1] == "http://127.0.0.1:8000"
