"""A bad ``SLUICE_*`` setting stops a process with one line naming the variable and the
value (exit status 2), from the ``sluice`` command and from each service's ``python -m``
entry point, never a traceback."""

from __future__ import annotations

import subprocess
import sys

import pytest
from pydantic import ValidationError
from typer.testing import CliRunner

from sluice.cli import app
from sluice.core.errors import StartupFailed
from sluice.core.settings import GatewaySettings, UpSettings, WorkerSettings, read_settings


def test_read_settings_names_each_bad_variable_and_its_value(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("SLUICE_HEARTBEAT_S", "-1")
    monkeypatch.setenv("SLUICE_MODEL_CONFIG_NAME", "../h100")
    monkeypatch.setenv("SLUICE_DEFAULT_MAX_BATCH_SIZE", "-4")
    with pytest.raises(StartupFailed) as info:
        read_settings(WorkerSettings)
    message = info.value.message
    assert "invalid setting SLUICE_HEARTBEAT_S='-1': Input should be greater than 0" in message
    assert "invalid setting SLUICE_MODEL_CONFIG_NAME='../h100'" in message
    assert "invalid setting SLUICE_DEFAULT_MAX_BATCH_SIZE='-4'" in message
    assert info.value.exit_status == 2


def test_a_validators_own_message_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLUICE_GATEWAY_PROCESSES", "many")
    with pytest.raises(StartupFailed) as info:
        read_settings(UpSettings)
    assert info.value.message.startswith(
        "invalid setting SLUICE_GATEWAY_PROCESSES='many': gateway_processes"
    )


@pytest.mark.parametrize(
    ("command", "variable", "value"),
    [
        (["up"], "SLUICE_NAMESPACE", "a b"),
        (["worker", "--model", "m"], "SLUICE_VISIBILITY_TIMEOUT_S", "soon"),
        (["gateway"], "SLUICE_DEFAULT_TIMEOUT_S", "-3"),
    ],
)
def test_the_command_line_says_which_setting_is_bad(
    command: list[str], variable: str, value: str
) -> None:
    result = CliRunner().invoke(app, command, env={variable: value, "COLUMNS": "400"})
    assert result.exit_code == 2, result.output
    assert f"error: invalid setting {variable}={value!r}: " in result.output
    assert "Traceback" not in result.output


@pytest.mark.slow  # (a process per entry point: the full suite's)
@pytest.mark.parametrize("module", ["sluice.gateway", "sluice.workers", "sluice.batch"])
def test_each_service_entry_point_says_which_setting_is_bad(module: str) -> None:
    args = ["--model-repository", "/nowhere", "--model", "m"] if module == "sluice.workers" else []
    result = subprocess.run(
        [sys.executable, "-m", module, *args],
        env={"SLUICE_NAMESPACE": "a{b}", "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("error: invalid setting SLUICE_NAMESPACE='a{b}': ")
    assert "Traceback" not in result.stderr


def test_good_settings_are_read_as_given() -> None:
    settings = read_settings(GatewaySettings, namespace="tenant-a")
    assert settings.namespace == "tenant-a"


def test_a_bad_secret_setting_is_named_but_its_value_is_not_shown(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("SLUICE_HTTP_RESTRICTED_API", "models:admin-key=top-secret")
    with pytest.raises(StartupFailed) as caught:
        read_settings(GatewaySettings)
    message = caught.value.message
    assert "SLUICE_HTTP_RESTRICTED_API=<hidden>" in message and "unknown API category" in message
    assert "top-secret" not in message


def test_grpc_tls_without_its_certificate_or_roots_is_refused_naming_them() -> None:
    with pytest.raises(ValidationError, match="SLUICE_GRPC_SERVER_CERT"):
        GatewaySettings(grpc_use_ssl=True)
    with pytest.raises(ValidationError, match="SLUICE_GRPC_ROOT_CERT"):
        GatewaySettings(grpc_use_ssl_mutual=True, grpc_server_cert="c.pem")
    taken = GatewaySettings(grpc_use_ssl=True, ssl_certfile="http.pem")
    assert taken.grpc_use_ssl and not taken.grpc_server_cert  # (the HTTP certificate serves)
    with pytest.raises(ValidationError, match="SLUICE_GRPC_SERVER_KEY is the key"):
        GatewaySettings(grpc_use_ssl=True, ssl_certfile="http.pem", grpc_server_key="k.pem")


def test_the_worker_stop_grace_is_read_under_its_on_demand_name_too(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """(It was on-demand's own before it applied to every worker.)"""
    assert UpSettings().worker_stop_grace_s == 30
    monkeypatch.setenv("SLUICE_ON_DEMAND_STOP_GRACE_S", "2")
    assert UpSettings().worker_stop_grace_s == 2
    monkeypatch.setenv("SLUICE_WORKER_STOP_GRACE_S", "3")
    assert UpSettings().worker_stop_grace_s == 3  # (its own name first)
    monkeypatch.setenv("SLUICE_WORKER_STOP_GRACE_S", "0")
    with pytest.raises(StartupFailed) as caught:
        read_settings(UpSettings)
    assert "SLUICE_WORKER_STOP_GRACE_S" in caught.value.message
