"""Where TorchServe's APIs listen: SLUICE_TORCHSERVE_PORTS and config.properties' addresses,
each bad entry named."""

from __future__ import annotations

import re

import pytest
from typer.testing import CliRunner

from sluice.cli import app
from sluice.core.settings import GatewaySettings
from sluice.core.torchserve.ports import Listen, from_properties, parse_ports


def test_ports_and_addresses() -> None:
    assert parse_ports("") == (None, None, None)
    assert parse_ports("8080,8081,8082") == (Listen("", 8080), Listen("", 8081), Listen("", 8082))
    assert parse_ports("0.0.0.0:9080, 0, [::1]:9082") == (
        Listen("0.0.0.0", 9080),
        None,
        Listen("::1", 9082),
    )
    assert parse_ports("9080") == (Listen("", 9080), None, None)


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ("8080,8081,8082,8083", "at most three entries"),
        ("8080,http,8082", "the management port 'http'"),
        ("8080,8081,70000", "the metrics port '70000'"),
        ("8080,8080", "a port of its own"),
        ("-1", "the inference port '-1'"),
    ],
)
def test_a_bad_entry_is_named(text: str, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        parse_ports(text)
    with pytest.raises(ValueError, match="torchserve_ports"):
        GatewaySettings(torchserve_ports=text)


def test_torchserve_s_addresses() -> None:
    assert from_properties({}) == ""
    assert (
        from_properties(
            {
                "inference_address": "http://0.0.0.0:8080",
                "metrics_address": "http://[::1]:8082",
                "number_of_netty_threads": "4",
            }
        )
        == "0.0.0.0:8080,0,[::1]:8082"
    )
    with pytest.raises(ValueError, match=r"management_address=https://x:8443: .*plain HTTP"):
        from_properties({"management_address": "https://x:8443"})
    with pytest.raises(
        ValueError, match=re.escape("inference_address=http://host: needs a host and a port")
    ):
        from_properties({"inference_address": "http://host"})


def test_sluice_up_names_a_bad_option_value(tmp_path: object) -> None:
    result = CliRunner().invoke(app, ["up", "--torchserve-ports", "8080,x"])
    assert result.exit_code == 2
    assert "--torchserve-ports" in result.output and "management port 'x'" in result.output
