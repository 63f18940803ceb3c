"""The bench says what to install when a C load generator is missing, and refuses options
that do not go with the load generator chosen."""

from __future__ import annotations

import pytest

from bench import c_loadgen, cli
from bench.report import cpu_per_request


def test_a_missing_tool_names_its_debian_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("bench.c_loadgen.shutil.which", lambda name: None)
    with pytest.raises(c_loadgen.ToolMissing, match="install the Debian package nghttp2-client"):
        c_loadgen.find_tool("h2load")
    with pytest.raises(c_loadgen.ToolMissing, match="install the Debian package wrk"):
        c_loadgen.find_tool("wrk")


def test_main_stops_before_starting_a_stack_when_the_tool_is_missing(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr("bench.c_loadgen.shutil.which", lambda name: None)
    assert cli.main(["--model", "mlp", "--loadgen", "wrk"]) == 2
    assert "install the Debian package wrk" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv",
    [
        ["--loadgen", "wrk", "--rate", "100"],
        ["--loadgen", "h2load"],
        ["--loadgen", "h2load", "--rate", "100", "--concurrency", "4"],
        ["--loadgen", "wrk", "--client", "aiohttp"],
    ],
)
def test_options_that_do_not_fit_the_load_generator_are_refused(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        cli.parse_args(["--model", "mlp", *argv])


def test_wrk_takes_concurrencies_and_h2load_rates() -> None:
    args = cli.parse_args(["--model", "mlp", "--loadgen", "wrk", "--concurrency", "64"])
    assert (args.concurrency, args.rate) == ([64], [])
    args = cli.parse_args(["--model", "mlp", "--loadgen", "h2load", "--rate", "100,1000"])
    assert (args.concurrency, args.rate) == ([], [100.0, 1000.0])


def test_cpu_per_request_sums_the_stack_without_the_load_generator() -> None:
    cpu = cpu_per_request({"gateway": 1.0, "worker": 2.0, "loadgen": 4.0}, 1000)
    assert cpu == {"gateway": 1.0, "worker": 2.0, "loadgen": 4.0, "stack": 3.0}
    assert cpu_per_request(None, 10) is None
    assert cpu_per_request({"gateway": 1.0}, 0) is None
