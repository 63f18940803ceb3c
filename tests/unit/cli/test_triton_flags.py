"""``sluice up`` takes tritonserver's flags (sluice/cli/triton_flags): mapped ones become
settings or SLUICE_* variables, ignored ones a warning naming them, refused ones an error
saying what to do instead; bad values and unknown options are errors naming them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import typer
import typer.main
from typer.testing import CliRunner

from sluice.cli import app
from sluice.cli.triton_flags import (
    FLAGS,
    FLAGS_LIST,
    FlagError,
    TritonArgs,
    parse,
)
from sluice.core.settings import GatewaySettings, UpSettings, WorkerSettings


def _up_options() -> set[str]:
    group = typer.main.get_command(app)
    up = group.commands["up"]  # type: ignore[attr-defined]
    return {name for param in up.params for name in [*param.opts, *param.secondary_opts]}


def _error(args: list[str]) -> str:
    with pytest.raises(typer.BadParameter) as caught:
        parse(args)
    return caught.value.format_message()


# --- the table --------------------------------------------------------------------------


def test_the_table_has_every_kind_and_no_flag_twice() -> None:
    assert len(FLAGS) == len(FLAGS_LIST)
    assert {flag.kind for flag in FLAGS_LIST} == {"option", "mapped", "ignored", "refused"}
    for flag in FLAGS_LIST:
        assert flag.does.strip(), flag.name
        if flag.kind == "mapped":
            assert flag.apply is not None, flag.name


def test_sluice_options_of_tritons_names_are_options_of_up_and_no_other_flag_is() -> None:
    options = _up_options()
    own = {flag.option for flag in FLAGS_LIST if flag.kind == "option"}
    assert own == {
        "--model-repository",
        "--model-store",
        "--http-address",
        "--http-port",
        "--grpc-port",
        "--metrics-port",
        "--model-control-mode",
        "--load-model",
    }
    assert own <= options
    # Any other Triton flag reaching click as an option of up would bypass the table.
    assert not {flag.option for flag in FLAGS_LIST if flag.kind != "option"} & options


def test_a_sluice_option_reaching_the_parser_is_no_triton_flag() -> None:
    assert "No such option: --http-port" in _error(["--http-port=8000"])


# --- mapped -------------------------------------------------------------------------------


def test_the_issues_command_line() -> None:
    result = parse(
        [
            "--repository-poll-secs=2",
            "--strict-readiness=false",
            "--exit-on-error=false",
            "--allow-grpc=false",
            "--allow-metrics=false",
            "--log-verbose=1",
            "--backend-config=onnxruntime,enable-global-threadpool=1",
        ]
    )
    assert result.overrides == {
        "repository_poll_s": 2.0,
        "exit_on_error": False,
        "grpc_port": 0,
        "metrics_port": 0,
    }
    assert result.environment == {
        "SLUICE_STRICT_READINESS": "false",
        "SLUICE_ALLOW_METRICS": "false",
        "SLUICE_LOG_VERBOSE_LEVEL": "1",
    }
    [warning] = result.warnings
    assert warning.startswith("warning: --backend-config=onnxruntime,enable-global-threadpool=1 ")
    assert "'enable-global-threadpool'" in warning and "backend onnxruntime" in warning


@pytest.mark.parametrize(
    ("args", "overrides", "environment"),
    [
        (
            ["--exit-timeout-secs=45"],
            {},
            {"SLUICE_SHUTDOWN_TIMEOUT_S": "45", "SLUICE_WORKER_STOP_GRACE_S": "45"},
        ),
        (["--log-verbose=true"], {}, {"SLUICE_LOG_VERBOSE_LEVEL": "1"}),
        (["--log-verbose=False"], {}, {"SLUICE_LOG_VERBOSE_LEVEL": "0"}),
        (["--log-verbose=3"], {}, {"SLUICE_LOG_VERBOSE_LEVEL": "3"}),
        (["--log-info=off"], {}, {"SLUICE_LOG_INFO": "false"}),
        (["--log-warning=0"], {}, {"SLUICE_LOG_WARNING": "false"}),
        (["--log-error=ON"], {}, {"SLUICE_LOG_ERROR": "true"}),
        (["--log-format=default"], {}, {"SLUICE_LOG_FORMAT": "text"}),
        (["--log-format=ISO8601"], {}, {"SLUICE_LOG_FORMAT": "iso8601"}),
        (["--log-file=/var/log/x.log"], {}, {"SLUICE_LOG_FILE": "/var/log/x.log"}),
        (["--exit-on-error=true"], {"exit_on_error": True}, {}),
        (["--strict-readiness=1"], {}, {"SLUICE_STRICT_READINESS": "true"}),
        (["--repository-poll-secs=7"], {"repository_poll_s": 7.0}, {}),
        (["--allow-grpc=true"], {}, {}),
        (["--allow-metrics=true"], {}, {"SLUICE_ALLOW_METRICS": "true"}),
        (
            ["--grpc-infer-response-compression-level=HIGH"],
            {},
            {"SLUICE_GRPC_RESPONSE_COMPRESSION": "gzip"},
        ),
        (
            ["--grpc-infer-response-compression-level=none"],
            {},
            {"SLUICE_GRPC_RESPONSE_COMPRESSION": "none"},
        ),
        (["--grpc-keepalive-time=7200000"], {}, {"SLUICE_GRPC_KEEPALIVE_TIME_S": "7200"}),
        (["--grpc-keepalive-timeout=500"], {}, {"SLUICE_GRPC_KEEPALIVE_TIMEOUT_S": "0.5"}),
        (
            ["--trace-config=opentelemetry,url=collector:4318/v1/traces"],
            {},
            {"SLUICE_OTLP_ENDPOINT": "http://collector:4318"},
        ),
        (
            ["--trace-config", "opentelemetry,resource=service.name=triton-a"],
            {},
            {"OTEL_SERVICE_NAME": "triton-a"},
        ),
        (["--trace-config=mode=opentelemetry"], {}, {}),
        (
            ["--cache-config=local,size=1048576"],
            {},
            {"SLUICE_RESPONSE_CACHE_BYTES": "1048576"},
        ),
        (["--response-cache-byte-size=1024"], {}, {"SLUICE_RESPONSE_CACHE_BYTES": "1024"}),
        (["--response-cache-byte-size=0"], {}, {"SLUICE_RESPONSE_CACHE_BYTES": "0"}),
        (["--model-config-name=h100"], {}, {"SLUICE_MODEL_CONFIG_NAME": "h100"}),
        (["--model-load-retry-count=2"], {"model_load_retry_count": 2}, {}),
        (
            ["--grpc-use-ssl=true", "--grpc-server-cert=c.pem", "--grpc-server-key", "k.pem"],
            {},
            {
                "SLUICE_GRPC_USE_SSL": "true",
                "SLUICE_GRPC_SERVER_CERT": "c.pem",
                "SLUICE_GRPC_SERVER_KEY": "k.pem",
            },
        ),
        (
            ["--grpc-use-ssl-mutual=1", "--grpc-root-cert=ca.pem"],
            {},
            {"SLUICE_GRPC_USE_SSL_MUTUAL": "true", "SLUICE_GRPC_ROOT_CERT": "ca.pem"},
        ),
        (
            [
                "--http-restricted-api=model-repository,shared-memory:admin-key=secret",
                "--http-restricted-api=inference:infer-key=v",
            ],
            {},
            {
                "SLUICE_HTTP_RESTRICTED_API": (
                    "model-repository,shared-memory:admin-key=secret;inference:infer-key=v"
                )
            },
        ),
        (
            ["--grpc-restricted-protocol", "health:k=v"],
            {},
            {"SLUICE_GRPC_RESTRICTED_PROTOCOL": "health:k=v"},
        ),
        (
            ["--http-header-forward-pattern=my_header.*"],
            {},
            {"SLUICE_HTTP_HEADER_FORWARD_PATTERN": "my_header.*"},
        ),
        (
            ["--grpc-header-forward-pattern", "(?-i)PREFIX_.*"],
            {},
            {"SLUICE_GRPC_HEADER_FORWARD_PATTERN": "(?-i)PREFIX_.*"},
        ),
        (["--model-load-retry-count", "0"], {"model_load_retry_count": 0}, {}),
        (["--model-config-name", "a100_80g.v2"], {}, {"SLUICE_MODEL_CONFIG_NAME": "a100_80g.v2"}),
    ],
)
def test_mapped_flags(
    args: list[str], overrides: dict[str, object], environment: dict[str, str]
) -> None:
    result = parse(args)
    assert (result.overrides, result.environment, result.warnings) == (overrides, environment, [])


def test_a_redis_cache_config_turns_the_cache_on_in_the_deployments_redis() -> None:
    result = parse(["--cache-config=redis,host=cache.local", "--cache-config=redis,port=6379"])
    assert result.environment == {"SLUICE_RESPONSE_CACHE_BYTES": str(256 * 1024 * 1024)}
    assert len(result.warnings) == 2 and "deployment's Redis" in result.warnings[0]
    sized = parse(["--cache-config=local,size=4096", "--cache-config=redis,host=cache.local"])
    assert sized.environment == {"SLUICE_RESPONSE_CACHE_BYTES": "4096"}


@pytest.mark.parametrize(
    "value",
    ["local,size=-1", "local,size=lots", "local,dir=/tmp", "memcached,size=10", "size"],
)
def test_bad_cache_configs_name_the_flag(value: str) -> None:
    with pytest.raises(typer.BadParameter) as caught:
        parse([f"--cache-config={value}"])
    assert "--cache-config" in str(caught.value.param_hint)


def test_equals_and_space_forms_mean_the_same() -> None:
    joined = parse(["--repository-poll-secs=3", "--log-file=a b", "--allow-grpc=off"])
    spaced = parse(["--repository-poll-secs", "3", "--log-file", "a b", "--allow-grpc", "off"])
    assert joined == spaced
    assert joined.overrides == {"repository_poll_s": 3.0, "grpc_port": 0}


@pytest.mark.parametrize("spelling", ["true", "TRUE", "True", "on", "On", "1"])
def test_true_spellings(spelling: str) -> None:
    assert parse([f"--strict-readiness={spelling}"]).environment == {
        "SLUICE_STRICT_READINESS": "true"
    }


@pytest.mark.parametrize("spelling", ["false", "FALSE", "off", "OFF", "0"])
def test_false_spellings(spelling: str) -> None:
    assert parse(["--exit-on-error", spelling]).overrides == {"exit_on_error": False}


def test_the_last_of_a_repeated_flag_wins_as_in_triton() -> None:
    result = parse(["--log-verbose=1", "--log-verbose=0"])
    assert result.environment == {"SLUICE_LOG_VERBOSE_LEVEL": "0"}


def test_mapped_variables_are_settings_that_accept_the_values(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    result = parse(
        [
            "--exit-timeout-secs=45",
            "--log-verbose=2",
            "--log-info=false",
            "--log-warning=false",
            "--log-error=false",
            "--log-format=ISO8601",
            "--strict-readiness=false",
            "--allow-metrics=false",
            "--grpc-infer-response-compression-level=low",
            "--grpc-keepalive-time=30000",
            "--grpc-keepalive-timeout=5000",
            "--trace-config=opentelemetry,url=http://collector:4318/v1/traces",
            "--trace-config=opentelemetry,resource=service.name=svc",
            "--repository-poll-secs=2",
            "--exit-on-error=true",
            "--allow-grpc=false",
            "--cache-config=local,size=65536",
        ]
    )
    for name, value in result.environment.items():
        monkeypatch.setenv(name, value)
    gateway = GatewaySettings()
    assert gateway.shutdown_timeout_s == 45
    assert gateway.strict_readiness is False
    assert gateway.allow_metrics is False
    assert gateway.grpc_response_compression == "gzip"
    assert (gateway.grpc_keepalive_time_s, gateway.grpc_keepalive_timeout_s) == (30, 5)
    assert gateway.otlp_endpoint == "http://collector:4318"
    assert gateway.otel_service_name == "svc"
    assert gateway.response_cache_bytes == 65536
    worker = WorkerSettings()
    assert (worker.log_verbose_level, worker.log_format) == (2, "iso8601")
    assert (worker.log_info, worker.log_warning, worker.log_error) == (False, False, False)
    up = UpSettings(**{"metrics_port": 8002, "grpc_port": 8001, **result.overrides})
    assert (up.repository_poll_s, up.exit_on_error) == (2.0, True)
    assert up.worker_stop_grace_s == 45  # (a worker stopping gets what a gateway gets)
    assert (up.grpc_port, up.metrics_port, up.allow_metrics) == (0, 0, False)


def test_exit_on_error_is_off_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SLUICE_EXIT_ON_ERROR", raising=False)
    assert UpSettings().exit_on_error is False


def test_an_exit_timeout_below_one_second_waits_one_second_and_says_so() -> None:
    result = parse(["--exit-timeout-secs=0"])
    assert result.environment == {
        "SLUICE_SHUTDOWN_TIMEOUT_S": "1",
        "SLUICE_WORKER_STOP_GRACE_S": "1",
    }
    [warning] = result.warnings
    assert "--exit-timeout-secs=0" in warning and "1 s" in warning


def test_grpc_and_metrics_addresses_must_be_the_http_address() -> None:
    result = parse(["--grpc-address=0.0.0.0", "--metrics-address", "0.0.0.0"])
    assert result.addresses == {"grpc-address": "0.0.0.0", "metrics-address": "0.0.0.0"}
    result.check_addresses("0.0.0.0")
    with pytest.raises(FlagError) as caught:
        result.check_addresses("127.0.0.1")
    message = caught.value.format_message()
    assert message.startswith("--grpc-address=0.0.0.0: ")
    assert "--http-address 0.0.0.0" in message
    TritonArgs().check_addresses("127.0.0.1")  # none given: nothing to check


# --- ignored ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args",
    [
        ["--http-thread-count=8"],
        ["--model-load-thread-count", "4"],
        ["--pinned-memory-pool-byte-size=268435456"],
        ["--cuda-memory-pool-byte-size=0:67108864"],
        ["--backend-directory=/opt/tritonserver/backends"],
        ["--repoagent-directory=/opt/tritonserver/repoagents"],
        ["--reuse-http-port=true"],
        ["--metrics-interval-ms=2000"],
        ["--id=triton-a"],
        ["--disable-auto-complete-config"],
        ["--strict-model-config=true"],
        ["--allow-gpu-metrics=false"],
        ["--trace-level=TIMESTAMPS"],
        ["--grpc-infer-thread-count=4"],
        ["--grpc-max-response-pool-size=16"],
        ["--enable-peer-access=true"],
    ],
)
def test_ignored_flags_warn_once_naming_the_flag(args: list[str]) -> None:
    result = parse(args)
    name = args[0].partition("=")[0]
    assert (result.overrides, result.environment) == ({}, {})
    [warning] = result.warnings
    assert warning.startswith(f"warning: {name} ignored: ")


def test_setting_flags_warn_once_per_setting_naming_it() -> None:
    result = parse(
        [
            "--backend-config=python,shm-default-byte-size=1048576",
            "--backend-config",
            "tensorflow,version=2",
            "--metrics-config=summary_latencies=true",
            "--trace-config=rate=100",
            "--trace-config=triton,file=/tmp/trace.json",
        ]
    )
    assert result.environment == {}
    assert len(result.warnings) == 5
    python, tensorflow, metrics, rate, file = result.warnings
    assert "'shm-default-byte-size'" in python and "backend python" in python
    assert "'version'" in tensorflow and "backend tensorflow" in tensorflow
    assert metrics.startswith("warning: --metrics-config=summary_latencies=true ignored")
    assert rate.startswith("warning: --trace-config=rate=100 ignored")
    assert file.startswith("warning: --trace-config=triton,file=/tmp/trace.json ignored")


def test_a_global_backend_setting_is_named_as_one() -> None:
    [warning] = parse(["--backend-config=some-setting=1"]).warnings
    assert "'some-setting' (every backend)" in warning


@pytest.mark.parametrize(
    "args",
    [
        ["--reuse-http-port=false"],
        ["--reuse-grpc-port=0"],
        ["--allow-gpu-metrics=true"],
        ["--allow-cpu-metrics=on"],
        ["--strict-model-config=false"],
    ],
)
def test_values_sluice_already_follows_are_taken_without_a_word(args: list[str]) -> None:
    assert parse(args) == TritonArgs()


def test_the_rate_limiter_and_its_resources_become_settings() -> None:
    args = ["--rate-limit=EXECUTION_COUNT", "--rate-limit-resource=R1:10"]
    args += ["--rate-limit-resource", "R2:5:0", "--rate-limit-resource=R2:8:1"]
    assert parse(args).environment == {
        "SLUICE_RATE_LIMIT": "execution_count",
        "SLUICE_RATE_LIMIT_RESOURCES": "R1:10,R2:5:0,R2:8:1",
    }
    assert parse(["--rate-limit", "off"]).environment == {"SLUICE_RATE_LIMIT": "off"}


def test_the_default_max_batch_size_becomes_a_setting() -> None:
    """Globally or for the onnxruntime backend (whose models Sluice completes from their
    files); another backend's is ignored with a warning, as its other settings are."""
    variable = "SLUICE_DEFAULT_MAX_BATCH_SIZE"
    assert parse(["--backend-config=default-max-batch-size=0"]).environment == {variable: "0"}
    onnx = parse(["--backend-config=onnxruntime,default-max-batch-size=16"])
    assert onnx.environment == {variable: "16"}
    other = parse(["--backend-config=tensorflow,default-max-batch-size=16"])
    assert other.environment == {}
    assert "'default-max-batch-size' (backend tensorflow)" in other.warnings[0]
    with pytest.raises(typer.BadParameter, match="0 or more"):
        parse(["--backend-config=default-max-batch-size=-1"])


def test_model_namespacing_becomes_a_setting_either_way() -> None:
    """Triton's --model-namespacing is SLUICE_MODEL_NAMESPACING (false too: the flag wins
    over a variable set before)."""
    on = parse(["--model-namespacing=true"])
    assert on.environment == {"SLUICE_MODEL_NAMESPACING": "true"} and not on.warnings
    assert parse(["--model-namespacing", "off"]).environment == {
        "SLUICE_MODEL_NAMESPACING": "false"
    }
    with pytest.raises(typer.BadParameter, match="invalid value for bool option: maybe"):
        parse(["--model-namespacing=maybe"])


def test_grpc_ping_policies_become_settings() -> None:
    args = ["--grpc-keepalive-permit-without-calls=true", "--grpc-http2-max-ping-strikes=0"]
    args += ["--grpc-http2-min-recv-ping-interval-without-data", "5000"]
    assert parse(args).environment == {
        "SLUICE_GRPC_KEEPALIVE_PERMIT_WITHOUT_CALLS": "true",
        "SLUICE_GRPC_HTTP2_MAX_PING_STRIKES": "0",
        "SLUICE_GRPC_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS": "5000",
    }
    with pytest.raises(typer.BadParameter, match="0 or more"):
        parse(["--grpc-http2-max-ping-strikes=-1"])


# --- refused ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "shown", "instead"),
    [
        (["--allow-http=false"], "--allow-http=false", "--http-address 127.0.0.1"),
        (["--allow-sagemaker=true"], "--allow-sagemaker=true", "SageMaker"),
        (["--allow-vertex-ai=1"], "--allow-vertex-ai=1", "Vertex AI"),
    ],
)
def test_refused_flags_name_the_flag_and_say_what_to_do(
    args: list[str], shown: str, instead: str
) -> None:
    with pytest.raises(FlagError) as caught:
        parse(args)
    message = caught.value.format_message()
    assert message.startswith(f"{shown}"), message
    assert instead in message


@pytest.mark.parametrize(
    "args",
    [
        ["--allow-http=true"],
        ["--allow-sagemaker=false"],
        ["--allow-vertex-ai=0"],
    ],
)
def test_refused_flags_with_values_sluice_follows_are_taken(args: list[str]) -> None:
    assert parse(args) == TritonArgs()


# --- bad values, bad names ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "name", "text"),
    [
        (["--repository-poll-secs=two"], "--repository-poll-secs", "'two' is not an integer"),
        (["--repository-poll-secs=0"], "--repository-poll-secs", "1 or more"),
        (["--strict-readiness=yes"], "--strict-readiness", "invalid value for bool option: yes"),
        (["--exit-on-error", "maybe"], "--exit-on-error", "invalid value for bool option: maybe"),
        (["--log-verbose=-1"], "--log-verbose", "0 or more"),
        (["--log-verbose=loud"], "--log-verbose", "'loud' is not an integer"),
        (["--log-format=json"], "--log-format", "json"),
        (["--grpc-keepalive-time=0"], "--grpc-keepalive-time", "more than 0"),
        (["--grpc-keepalive-timeout=soon"], "--grpc-keepalive-timeout", "not an integer"),
        (["--grpc-infer-response-compression-level=max"], "--grpc-infer-", "max"),
        (["--http-thread-count=many"], "--http-thread-count", "'many' is not an integer"),
        (["--metrics-interval-ms=often"], "--metrics-interval-ms", "'often' is not a number"),
        (["--reuse-http-port=perhaps"], "--reuse-http-port", "invalid value for bool"),
        (["--rate-limit-resource"], "--rate-limit-resource", "requires a value"),
        (["--rate-limit-resource=R1"], "--rate-limit-resource", "<name>:<count>"),
        (["--rate-limit-resource=R1:x"], "--rate-limit-resource", "whole number"),
        (["--rate-limit-resource=R1:1:gpu"], "--rate-limit-resource", "GPU number"),
        (["--rate-limit=fast"], "--rate-limit", "off, execution_count"),
        (["--backend-config=,x=1"], "--backend-config", "<name>,<setting>=<value>"),
        (["--backend-config=onnxruntime,threads"], "--backend-config", "<setting>=<value>"),
        (["--backend-config=onnxruntime,threads="], "--backend-config", "<setting>=<value>"),
        (
            ["--backend-config=default-max-batch-size=big"],
            "--backend-config",
            "'big' is not an integer",
        ),
        (["--trace-config=zipkin,url=x"], "--trace-config", "triton or opentelemetry"),
        (["--disable-auto-complete-config=true"], "--disable-auto-complete-config", "no value"),
        (["--model-config-name=../h100"], "--model-config-name", "'../h100'"),
        (["--model-load-retry-count=-1"], "--model-load-retry-count", "0 to 100"),
        (["--http-restricted-api=models:k=v"], "--http-restricted-api", "unknown API category"),
        (["--grpc-restricted-protocol=health"], "--grpc-restricted-protocol", "<header>=<value>"),
        (
            ["--http-restricted-api=health:a=1", "--http-restricted-api=health:b=2"],
            "--http-restricted-api",
            "more than one group",
        ),
        (["--http-header-forward-pattern=my_(.*"], "--http-header-forward-pattern", "my_(.*"),
        (["--model-load-retry-count=twice"], "--model-load-retry-count", "not an integer"),
        (["--model-config-name=h 100"], "--model-config-name", "no space"),
        (["--model-config-name=configs/h100"], "--model-config-name", "configs/"),
    ],
)
def test_bad_values_name_the_flag_and_the_value(args: list[str], name: str, text: str) -> None:
    message = _error(args)
    assert name in message and text in message, message


def test_an_unknown_option_is_named_with_close_names() -> None:
    assert _error(["--no-such-flag=1"]) == "No such option: --no-such-flag"
    message = _error(["--repository-pol-secs=2"])
    assert message.startswith("No such option: --repository-pol-secs")
    assert "--repository-poll-secs" in message
    with pytest.raises(FlagError) as caught:
        parse(["--http-prt=1"], sluice_options=["--http-port"])
    assert caught.value.format_message() == "No such option: --http-prt Did you mean --http-port?"


def test_an_unknown_short_option_is_named() -> None:
    assert _error(["-x"]) == "No such option: -x"


def test_a_stray_argument_is_named() -> None:
    assert _error(["serve"]) == "Got unexpected extra argument (serve)"
    assert _error(["--log-verbose=1", "extra"]) == "Got unexpected extra argument (extra)"


# --- through the command line ----------------------------------------------------------------


def _flat(text: str) -> str:
    """Rich draws errors in a box, wrapped: its words, one space apart."""
    for frame in "│╭╮╰╯─":
        text = text.replace(frame, " ")
    return " ".join(text.split())


@pytest.mark.parametrize(
    ("args", "text"),
    [
        (["--no-such-flag"], "No such option: --no-such-flag"),
        (["--rate-limit=sometimes"], "invalid value for rate limit mode: sometimes"),
        (["--repository-poll-secs", "x"], "Invalid value for '--repository-poll-secs'"),
        # Both repositories are taken (and the first, missing, stops it).
        (["--model-repository", "/a", "--model-store=/b"], "cannot list the model repository /a"),
        (["--grpc-address=10.0.0.1"], "--grpc-address=10.0.0.1: Sluice serves"),
    ],
)
def test_up_stops_before_starting_anything_on_a_bad_flag(args: list[str], text: str) -> None:
    result = CliRunner().invoke(app, ["up", *args], env={"COLUMNS": "400"})
    assert result.exit_code == 2, result.output
    assert text in _flat(result.output)


def test_up_warns_about_ignored_flags_and_goes_on(tmp_path: Path) -> None:
    """Past the flags: it starts, and stops at the missing repository, as without them."""
    missing = tmp_path / "missing"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "sluice.cli",
            "up",
            f"--model-store={missing}",
            "--http-thread-count",
            "16",
            "--backend-config=onnxruntime,enable-global-threadpool=1",
            "--log-verbose=1",
            "--allow-grpc=false",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2, result.stderr
    lines = result.stderr.splitlines()
    assert any(line.startswith("warning: --http-thread-count ignored: ") for line in lines)
    assert any(line.startswith("warning: --backend-config=onnxruntime,") for line in lines)
    assert str(missing) in lines[-1] and lines[-1].startswith("error: ")


def test_the_command_line_reference_lists_every_flag() -> None:
    """The page is generated from the table (docs/gen_reference.py; the docs reference test
    keeps it current): every flag has its row, with its kind."""
    page = (Path(__file__).resolve().parents[3] / "docs" / "reference" / "cli.md").read_text()
    section = page.split("\n## Triton's flags\n", 1)[1]
    for flag in FLAGS_LIST:
        assert f"| `{flag.option}` | " in section, flag.name
