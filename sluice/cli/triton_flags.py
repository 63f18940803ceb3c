"""Triton's command line for ``sluice up``: tritonserver's flags, spelled as Triton spells them.

:data:`FLAGS` is the one table of every flag of ``tritonserver`` and what Sluice does with it:

- ``option``: ``sluice up`` has an option of that name (``--http-port``, ``--model-store``, ...);
- ``mapped``: the flag becomes a setting of ``sluice up`` (:class:`TritonArgs.overrides`) or a
  ``SLUICE_*`` variable set before anything reads settings (:class:`TritonArgs.environment`),
  which the gateways and workers ``sluice up`` starts inherit;
- ``ignored``: tuning of Triton's own internals that means nothing here; accepted with one
  warning line naming it;
- ``refused``: ignoring it would quietly change what the deployment does (model namespacing,
  turning HTTP off, ...); an error says what to do instead.

A flag may also have values for which Sluice already does what they ask (``--allow-http=true``,
``--grpc-use-ssl=false``): those are taken without a word, whatever its kind.

:func:`parse` reads what click left over (``ctx.args`` of ``sluice up``), ``--flag=value`` or
``--flag value``, and values as Triton parses them (booleans: ``true``/``on``/``1`` and
``false``/``off``/``0``, any case). A bad value is a :class:`typer.BadParameter` naming the
flag; a refused flag, and an option neither Sluice nor Triton has (``No such option``), a
:class:`FlagError`.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import typer

from sluice.core.dispatch import STREAM_BACKLOG
from sluice.core.rate_limit import MODES, parse_resource_counts
from sluice.core.repository import CONFIG_NAME
from sluice.core.request_parameters import forward_pattern
from sluice.core.restricted_api import parse_restrictions

Kind = Literal["option", "mapped", "ignored", "refused"]
ValueKind = Literal["bool", "int", "float", "text", "none"]

_DEFAULT_MAX_BATCH_SIZE = "SLUICE_DEFAULT_MAX_BATCH_SIZE"
_AUTOCOMPLETING_BACKENDS = ("", "onnxruntime")
"""The backends whose models Sluice completes from the model file ("": every backend)."""


class FlagError(typer.BadParameter):
    """A Triton flag Sluice refuses, or an option nobody has: a usage error (exit status 2)
    shown as it is, without click's ``Invalid value for`` before it."""

    def format_message(self) -> str:
        return self.message


@dataclass
class TritonArgs:
    """What Triton's flags ask of ``sluice up``."""

    overrides: dict[str, Any] = field(default_factory=dict)
    """Fields of UpSettings."""
    environment: dict[str, str] = field(default_factory=dict)
    """``SLUICE_*`` variables for ``sluice up`` and every process it starts."""
    warnings: list[str] = field(default_factory=list)
    """One line per flag (or backend setting) accepted but ignored."""
    addresses: dict[str, str] = field(default_factory=dict)
    """``--grpc-address`` / ``--metrics-address`` as given: Sluice serves every port on the
    HTTP address, so each must be that one (see :meth:`check_addresses`)."""

    def check_addresses(self, http_host: str) -> None:
        """Refuse an address other than the HTTP address (known once settings are read)."""
        for name, address in self.addresses.items():
            if address != http_host:
                raise FlagError(
                    f"--{name}={address}: Sluice serves HTTP, gRPC and metrics on one address, "
                    f"here {http_host}; give --http-address {address} instead"
                )


@dataclass(frozen=True)
class TritonFlag:
    """One flag of ``tritonserver`` and what Sluice does with it."""

    name: str
    """Without the leading ``--``."""
    value: ValueKind
    kind: Kind
    does: str
    """What Sluice does with it (for ``ignored``: why it is ignored; for ``refused``: what to
    do instead). One sentence or two, shown in the warning, the error and the docs."""
    apply: Callable[[TritonFlag, str, TritonArgs], None] | None = None
    """``mapped`` (and flags with settings of their own): record what the value asks."""
    fine: Callable[[str], bool] | None = None
    """Values for which Sluice already does what the flag asks: taken without a word."""

    @property
    def option(self) -> str:
        return f"--{self.name}"


# --- values, as Triton parses them --------------------------------------------------------

_TRUE = ("true", "on", "1")
_FALSE = ("false", "off", "0")


def bad_value(flag: TritonFlag | str, message: str) -> typer.BadParameter:
    name = flag.option if isinstance(flag, TritonFlag) else flag
    return typer.BadParameter(message, param_hint=f"'{name}'")


def parse_bool(flag: TritonFlag, text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise bad_value(flag, f"invalid value for bool option: {text}")


def parse_int(flag: TritonFlag, text: str) -> int:
    try:
        return int(text.strip())
    except ValueError:
        raise bad_value(flag, f"{text!r} is not an integer") from None


def parse_float(flag: TritonFlag, text: str) -> float:
    try:
        return float(text.strip())
    except ValueError:
        raise bad_value(flag, f"{text!r} is not a number") from None


_VALUE_CHECKS: dict[ValueKind, Callable[[TritonFlag, str], object]] = {
    "bool": parse_bool,
    "int": parse_int,
    "float": parse_float,
    "text": lambda _flag, text: text,
    "none": lambda _flag, text: text,
}


def _is(wanted: bool) -> Callable[[str], bool]:
    """Values of a bool flag that mean ``wanted``."""
    return lambda text: text.strip().lower() in (_TRUE if wanted else _FALSE)


# --- what mapped flags do ----------------------------------------------------------------


def _env_bool(variable: str) -> Callable[[TritonFlag, str, TritonArgs], None]:
    def apply(flag: TritonFlag, text: str, out: TritonArgs) -> None:
        out.environment[variable] = "true" if parse_bool(flag, text) else "false"

    return apply


def _env_text(variable: str) -> Callable[[TritonFlag, str, TritonArgs], None]:
    def apply(_flag: TritonFlag, text: str, out: TritonArgs) -> None:
        out.environment[variable] = text

    return apply


def _env_count(variable: str) -> Callable[[TritonFlag, str, TritonArgs], None]:
    """A whole number, 0 or more."""

    def apply(flag: TritonFlag, text: str, out: TritonArgs) -> None:
        number = parse_int(flag, text)
        if number < 0:
            raise bad_value(flag, f"{text}: a whole number, 0 or more")
        out.environment[variable] = str(number)

    return apply


def _env_seconds_from_ms(variable: str) -> Callable[[TritonFlag, str, TritonArgs], None]:
    """Triton's milliseconds as Sluice's seconds (more than 0)."""

    def apply(flag: TritonFlag, text: str, out: TritonArgs) -> None:
        milliseconds = parse_int(flag, text)
        if milliseconds <= 0:
            raise bad_value(flag, f"{text}: milliseconds, more than 0")
        out.environment[variable] = f"{milliseconds / 1000:g}"

    return apply


def _log_verbose(flag: TritonFlag, text: str, out: TritonArgs) -> None:
    lowered = text.strip().lower()
    level = {"true": 1, "false": 0}.get(lowered)
    if level is None:
        level = parse_int(flag, text)
    if level < 0:
        raise bad_value(flag, f"{text}: a level of 0 or more (or true / false)")
    out.environment["SLUICE_LOG_VERBOSE_LEVEL"] = str(level)


_LOG_FORMATS = {"default": "text", "iso8601": "iso8601"}


def _log_format(flag: TritonFlag, text: str, out: TritonArgs) -> None:
    fmt = _LOG_FORMATS.get(text.strip().lower())
    if fmt is None:
        raise bad_value(flag, f"invalid argument for --log-format: {text} (default or ISO8601)")
    out.environment["SLUICE_LOG_FORMAT"] = fmt


def _exit_timeout(flag: TritonFlag, text: str, out: TritonArgs) -> None:
    seconds = parse_int(flag, text)
    if seconds < 1:
        out.warnings.append(
            f"warning: {flag.option}={text}: Sluice's gateways wait at least 1 s for "
            "in-flight requests; waiting 1 s"
        )
        seconds = 1
    out.environment["SLUICE_SHUTDOWN_TIMEOUT_S"] = str(seconds)


def _exit_on_error(flag: TritonFlag, text: str, out: TritonArgs) -> None:
    out.overrides["exit_on_error"] = parse_bool(flag, text)


def _poll_secs(flag: TritonFlag, text: str, out: TritonArgs) -> None:
    seconds = parse_int(flag, text)
    if seconds < 1:
        raise bad_value(flag, f"{text}: seconds between polls, 1 or more")
    out.overrides["repository_poll_s"] = float(seconds)


def _forward_pattern(variable: str) -> Callable[[TritonFlag, str, TritonArgs], None]:
    def apply(flag: TritonFlag, text: str, out: TritonArgs) -> None:
        try:
            forward_pattern(text)
        except re.error as exc:
            raise bad_value(flag, f"{text!r} is not a regular expression: {exc}") from None
        out.environment[variable] = text

    return apply


def _restricted(variable: str) -> Callable[[TritonFlag, str, TritonArgs], None]:
    """A restricted-API group (repeatable: the groups join with ';')."""

    def apply(flag: TritonFlag, text: str, out: TritonArgs) -> None:
        joined = ";".join(filter(None, (out.environment.get(variable, ""), text)))
        try:
            parse_restrictions(joined)
        except ValueError as exc:
            raise bad_value(flag, str(exc)) from None
        out.environment[variable] = joined

    return apply


def _rate_limit(flag: TritonFlag, text: str, out: TritonArgs) -> None:
    mode = text.strip().lower()
    if mode not in MODES:
        raise bad_value(flag, f"invalid value for rate limit mode: {text} (off, execution_count)")
    out.environment["SLUICE_RATE_LIMIT"] = mode


def _rate_limit_resource(flag: TritonFlag, text: str, out: TritonArgs) -> None:
    """One resource's count (repeatable: the counts join with ',')."""
    try:
        parse_resource_counts(text)
    except ValueError as exc:
        raise bad_value(flag, str(exc)) from None
    variable = "SLUICE_RATE_LIMIT_RESOURCES"
    out.environment[variable] = ",".join(filter(None, (out.environment.get(variable), text)))


def _load_retries(flag: TritonFlag, text: str, out: TritonArgs) -> None:
    retries = parse_int(flag, text)
    if not 0 <= retries <= 100:
        raise bad_value(flag, f"{text}: retries of a failed load, 0 to 100")
    out.overrides["model_load_retry_count"] = retries


def _model_config_name(flag: TritonFlag, text: str, out: TritonArgs) -> None:
    if not CONFIG_NAME.fullmatch(text):
        raise bad_value(
            flag,
            f"{text!r}: the name of a file in each model's configs/ folder, without '.pbtxt' "
            "(letters, digits, '_', '.', '-'; no space)",
        )
    out.environment["SLUICE_MODEL_CONFIG_NAME"] = text


def _allow_grpc(flag: TritonFlag, text: str, out: TritonArgs) -> None:
    if not parse_bool(flag, text):
        out.overrides["grpc_port"] = 0


def _allow_metrics(flag: TritonFlag, text: str, out: TritonArgs) -> None:
    allowed = parse_bool(flag, text)
    out.environment["SLUICE_ALLOW_METRICS"] = "true" if allowed else "false"
    if not allowed:
        out.overrides["metrics_port"] = 0


def _address(flag: TritonFlag, text: str, out: TritonArgs) -> None:
    out.addresses[flag.name] = text


_COMPRESSION = {"none": "none", "low": "gzip", "medium": "gzip", "high": "gzip"}


def _compression(flag: TritonFlag, text: str, out: TritonArgs) -> None:
    algorithm = _COMPRESSION.get(text.strip().lower())
    if algorithm is None:
        raise bad_value(flag, f"{text}: none, low, medium or high")
    out.environment["SLUICE_GRPC_RESPONSE_COMPRESSION"] = algorithm


def _setting(flag: TritonFlag, text: str, *, group_required: bool) -> tuple[str, str, str]:
    """``<group>,<setting>=<value>`` (or ``<setting>=<value>`` where the group may be left
    out): (group, setting, value)."""
    group, comma, rest = text.partition(",")
    if not comma or "=" in group:
        group, rest = "", text
    setting, equals, value = rest.partition("=")
    if (comma and not group) or (group_required and not group) or not equals:
        raise bad_value(flag, f"{text}: the format is <name>,<setting>=<value>")
    if not setting or not value:
        raise bad_value(flag, f"{text}: the format is <name>,<setting>=<value>")
    return group, setting, value


def _backend_config(flag: TritonFlag, text: str, out: TritonArgs) -> None:
    backend, setting, value = _setting(flag, text, group_required=False)
    if setting == "default-max-batch-size" and backend in _AUTOCOMPLETING_BACKENDS:
        size = parse_int(flag, value)
        if not 0 <= size <= 2**31 - 1:
            raise bad_value(flag, f"{text}: the default max batch size is 0 or more")
        out.environment[_DEFAULT_MAX_BATCH_SIZE] = str(size)
        return
    where = f"backend {backend}" if backend else "every backend"
    out.warnings.append(
        f"warning: {flag.option}={text} ignored: Sluice's backends take no setting "
        f"'{setting}' ({where})"
    )


REDIS_CACHE_BYTES = 256 * 1024 * 1024
"""The response cache's room when ``--cache-config redis,...`` gives none (Triton's Redis
cache is bounded by Redis itself; Sluice's shares the deployment's Redis, so it has one)."""

_CACHE_BYTES = "SLUICE_RESPONSE_CACHE_BYTES"


def _cache_config(flag: TritonFlag, text: str, out: TritonArgs) -> None:
    kind, setting, value = _setting(flag, text, group_required=True)
    kind = kind.lower()
    if kind == "local" and setting == "size":
        size = parse_int(flag, value)
        if size < 0:
            raise bad_value(flag, f"{text}: the size is a number of bytes, 0 or more")
        out.environment[_CACHE_BYTES] = str(size)
    elif kind == "local":
        raise bad_value(flag, f"{text}: the local cache takes one setting, size=<bytes>")
    elif kind == "redis":
        out.environment.setdefault(_CACHE_BYTES, str(REDIS_CACHE_BYTES))
        out.warnings.append(
            f"warning: {flag.option}={text} ignored: Sluice keeps its response cache in the "
            f"deployment's Redis, with room for {int(out.environment[_CACHE_BYTES]):,} bytes "
            "(--cache-config local,size=<bytes> sets it)"
        )
    else:
        raise bad_value(flag, f"{text}: the cache is local or redis")


def _cache_bytes(flag: TritonFlag, text: str, out: TritonArgs) -> None:
    size = parse_int(flag, text)
    if size < 0:
        raise bad_value(flag, f"{text}: a number of bytes, 0 or more")
    out.environment[_CACHE_BYTES] = str(size)


def _metrics_config(flag: TritonFlag, text: str, out: TritonArgs) -> None:
    _group, setting, _value = _setting(flag, text, group_required=False)
    out.warnings.append(
        f"warning: {flag.option}={text} ignored: Sluice's metrics take no setting "
        f"'{setting}' (they are computed when scraped, as histograms)"
    )


_TRACES_PATH = "/v1/traces"


def _trace_config(flag: TritonFlag, text: str, out: TritonArgs) -> None:
    mode, setting, value = _setting(flag, text, group_required=False)
    if mode and mode.lower() not in ("triton", "opentelemetry"):
        raise bad_value(flag, f"{text}: the trace mode is triton or opentelemetry")
    if mode.lower() == "opentelemetry" and setting == "url":
        url = value if "://" in value else f"http://{value}"
        if url.endswith(_TRACES_PATH):
            url = url[: -len(_TRACES_PATH)]
        out.environment["SLUICE_OTLP_ENDPOINT"] = url
        return
    if mode.lower() == "opentelemetry" and setting == "resource":
        key, equals, name = value.partition("=")
        if equals and key == "service.name":
            out.environment["OTEL_SERVICE_NAME"] = name
            return
    if not mode and setting == "mode" and value.lower() == "opentelemetry":
        return
    out.warnings.append(
        f"warning: {flag.option}={text} ignored: Sluice traces every request with "
        "OpenTelemetry while an endpoint is set (--trace-config opentelemetry,url=...)"
    )


# --- the table ----------------------------------------------------------------------------

_IGNORED_TUNING = "tuning of Triton's own threads and memory, which Sluice does not have"

FLAGS_LIST: tuple[TritonFlag, ...] = (
    # Server
    TritonFlag("id", "text", "ignored", "Sluice names itself sluice in server metadata."),
    TritonFlag(
        "exit-timeout-secs",
        "int",
        "mapped",
        "SLUICE_SHUTDOWN_TIMEOUT_S: how long a stopping gateway waits for in-flight "
        "requests (at least 1 s).",
        _exit_timeout,
    ),
    # Logging
    TritonFlag(
        "log-verbose",
        "int",
        "mapped",
        "SLUICE_LOG_VERBOSE_LEVEL (true is 1, false is 0): 1 or more logs debug messages too.",
        _log_verbose,
    ),
    TritonFlag("log-info", "bool", "mapped", "SLUICE_LOG_INFO.", _env_bool("SLUICE_LOG_INFO")),
    TritonFlag(
        "log-warning", "bool", "mapped", "SLUICE_LOG_WARNING.", _env_bool("SLUICE_LOG_WARNING")
    ),
    TritonFlag("log-error", "bool", "mapped", "SLUICE_LOG_ERROR.", _env_bool("SLUICE_LOG_ERROR")),
    TritonFlag(
        "log-format",
        "text",
        "mapped",
        "SLUICE_LOG_FORMAT: default is text, ISO8601 is iso8601.",
        _log_format,
    ),
    TritonFlag(
        "log-file",
        "text",
        "mapped",
        "SLUICE_LOG_FILE: every process appends its lines to the file.",
        _env_text("SLUICE_LOG_FILE"),
    ),
    # Model repository
    TritonFlag("model-store", "text", "option", "Sluice's option, as --model-repository."),
    TritonFlag(
        "model-repository",
        "text",
        "option",
        "Sluice's option; given more than once, the repositories are served together, as "
        "in Triton.",
    ),
    TritonFlag(
        "exit-on-error",
        "bool",
        "mapped",
        "SLUICE_EXIT_ON_ERROR: true makes sluice up exit with status 1, naming the models, "
        "when a model fails to load at start. Sluice's default is false, Triton's true.",
        _exit_on_error,
    ),
    TritonFlag(
        "disable-auto-complete-config",
        "none",
        "ignored",
        "Sluice always completes a missing or partial configuration from the model file.",
    ),
    TritonFlag(
        "strict-readiness",
        "bool",
        "mapped",
        "SLUICE_STRICT_READINESS.",
        _env_bool("SLUICE_STRICT_READINESS"),
    ),
    TritonFlag("model-control-mode", "text", "option", "Sluice's option (any case)."),
    TritonFlag(
        "repository-poll-secs",
        "int",
        "mapped",
        "SLUICE_REPOSITORY_POLL_S: seconds between listings of the repository, 1 or more.",
        _poll_secs,
    ),
    TritonFlag("load-model", "text", "option", "Sluice's option, repeatable."),
    TritonFlag(
        "model-config-name",
        "text",
        "mapped",
        "SLUICE_MODEL_CONFIG_NAME: a model with configs/<name>.pbtxt is served with it "
        "instead of its config.pbtxt.",
        _model_config_name,
    ),
    TritonFlag(
        "model-load-thread-count",
        "int",
        "ignored",
        "Sluice loads every model at once, each instance in a worker process of its own.",
    ),
    TritonFlag(
        "model-load-retry-count",
        "int",
        "mapped",
        "SLUICE_MODEL_LOAD_RETRY_COUNT: a worker that failed to load its model is started "
        "again at once, this many times, before the model is UNAVAILABLE with the reason.",
        _load_retries,
    ),
    TritonFlag(
        "model-namespacing",
        "bool",
        "refused",
        "Sluice keeps model names unique across the repositories (a name found in two or "
        "more is unavailable, as in Triton without namespacing); serve each namespace with "
        "a sluice up of its own.",
        fine=_is(False),
    ),
    # HTTP
    TritonFlag(
        "allow-http",
        "bool",
        "refused",
        "Sluice always serves HTTP (its readiness and control go through it); leave the flag "
        "out, or bind --http-address 127.0.0.1 to keep it local.",
        fine=_is(True),
    ),
    TritonFlag("http-address", "text", "option", "Sluice's option, as --http-host."),
    TritonFlag("http-port", "int", "option", "Sluice's option."),
    TritonFlag(
        "reuse-http-port",
        "bool",
        "ignored",
        "sluice up's own gateway processes share the HTTP port; another server cannot.",
        fine=_is(False),
    ),
    TritonFlag(
        "http-header-forward-pattern",
        "text",
        "mapped",
        "SLUICE_HTTP_HEADER_FORWARD_PATTERN: headers whose names match become string "
        "parameters of each inference request (ignoring case unless the pattern starts with "
        "(?-i)); Authorization never does.",
        _forward_pattern("SLUICE_HTTP_HEADER_FORWARD_PATTERN"),
    ),
    TritonFlag("http-thread-count", "int", "ignored", _IGNORED_TUNING + "."),
    TritonFlag(
        "http-restricted-api",
        "text",
        "mapped",
        "SLUICE_HTTP_RESTRICTED_API (repeatable; groups joined by ';'): the endpoints of "
        "the categories named answer 403 without the header; beside Sluice's API keys.",
        _restricted("SLUICE_HTTP_RESTRICTED_API"),
    ),
    # GRPC
    TritonFlag(
        "allow-grpc",
        "bool",
        "mapped",
        "false: no gRPC port (grpc_port 0), whatever --grpc-port says.",
        _allow_grpc,
    ),
    TritonFlag(
        "grpc-address",
        "text",
        "mapped",
        "accepted when it is the HTTP address (--http-address), which Sluice serves gRPC on; "
        "another address is refused.",
        _address,
    ),
    TritonFlag("grpc-port", "int", "option", "Sluice's option."),
    TritonFlag(
        "reuse-grpc-port",
        "bool",
        "ignored",
        "sluice up's own gateway processes share the gRPC port; another server cannot.",
        fine=_is(False),
    ),
    TritonFlag(
        "grpc-header-forward-pattern",
        "text",
        "mapped",
        "SLUICE_GRPC_HEADER_FORWARD_PATTERN: metadata whose names match become string "
        "parameters of each inference request, as --http-header-forward-pattern.",
        _forward_pattern("SLUICE_GRPC_HEADER_FORWARD_PATTERN"),
    ),
    TritonFlag("grpc-infer-allocation-pool-size", "int", "ignored", _IGNORED_TUNING + "."),
    TritonFlag("grpc-infer-thread-count", "int", "ignored", _IGNORED_TUNING + "."),
    TritonFlag(
        "grpc-max-response-pool-size",
        "int",
        "ignored",
        f"a gateway holds at most {STREAM_BACKLOG:,} responses of a decoupled model for one "
        "slow client, then ends that stream with an error.",
    ),
    TritonFlag(
        "grpc-use-ssl",
        "bool",
        "mapped",
        "SLUICE_GRPC_USE_SSL: gRPC over TLS with --grpc-server-cert and --grpc-server-key "
        "(else the HTTP certificate, SLUICE_SSL_CERTFILE).",
        _env_bool("SLUICE_GRPC_USE_SSL"),
    ),
    TritonFlag(
        "grpc-use-ssl-mutual",
        "bool",
        "mapped",
        "SLUICE_GRPC_USE_SSL_MUTUAL: gRPC over TLS, accepting only clients whose "
        "certificate --grpc-root-cert signed.",
        _env_bool("SLUICE_GRPC_USE_SSL_MUTUAL"),
    ),
    TritonFlag(
        "grpc-server-cert",
        "text",
        "mapped",
        "SLUICE_GRPC_SERVER_CERT: the gRPC port's certificate (with --grpc-use-ssl).",
        _env_text("SLUICE_GRPC_SERVER_CERT"),
    ),
    TritonFlag(
        "grpc-server-key",
        "text",
        "mapped",
        "SLUICE_GRPC_SERVER_KEY: the private key of --grpc-server-cert.",
        _env_text("SLUICE_GRPC_SERVER_KEY"),
    ),
    TritonFlag(
        "grpc-root-cert",
        "text",
        "mapped",
        "SLUICE_GRPC_ROOT_CERT: the authorities whose client certificates "
        "--grpc-use-ssl-mutual accepts.",
        _env_text("SLUICE_GRPC_ROOT_CERT"),
    ),
    TritonFlag(
        "grpc-infer-response-compression-level",
        "text",
        "mapped",
        "SLUICE_GRPC_RESPONSE_COMPRESSION: none is none; low, medium and high are gzip.",
        _compression,
    ),
    TritonFlag(
        "grpc-keepalive-time",
        "int",
        "mapped",
        "SLUICE_GRPC_KEEPALIVE_TIME_S (Triton's milliseconds as seconds).",
        _env_seconds_from_ms("SLUICE_GRPC_KEEPALIVE_TIME_S"),
    ),
    TritonFlag(
        "grpc-keepalive-timeout",
        "int",
        "mapped",
        "SLUICE_GRPC_KEEPALIVE_TIMEOUT_S (Triton's milliseconds as seconds).",
        _env_seconds_from_ms("SLUICE_GRPC_KEEPALIVE_TIMEOUT_S"),
    ),
    TritonFlag(
        "grpc-keepalive-permit-without-calls",
        "bool",
        "mapped",
        "SLUICE_GRPC_KEEPALIVE_PERMIT_WITHOUT_CALLS: clients may ping connections without "
        "calls (idle connections still close after SLUICE_GRPC_MAX_CONNECTION_IDLE_S).",
        _env_bool("SLUICE_GRPC_KEEPALIVE_PERMIT_WITHOUT_CALLS"),
    ),
    TritonFlag(
        "grpc-http2-max-pings-without-data",
        "int",
        "ignored",
        "Sluice's gateway pings only connections with calls open, without a limit.",
    ),
    TritonFlag(
        "grpc-http2-min-recv-ping-interval-without-data",
        "int",
        "mapped",
        "SLUICE_GRPC_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS: a client ping sooner than "
        "this without data between is a strike.",
        _env_count("SLUICE_GRPC_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS"),
    ),
    TritonFlag(
        "grpc-http2-max-ping-strikes",
        "int",
        "mapped",
        "SLUICE_GRPC_HTTP2_MAX_PING_STRIKES: a client past this many strikes is sent away "
        "(0: never).",
        _env_count("SLUICE_GRPC_HTTP2_MAX_PING_STRIKES"),
    ),
    TritonFlag(
        "grpc-max-connection-age",
        "int",
        "ignored",
        "Sluice closes gRPC connections only once idle (SLUICE_GRPC_MAX_CONNECTION_IDLE_S).",
    ),
    TritonFlag(
        "grpc-max-connection-age-grace",
        "int",
        "ignored",
        "Sluice closes gRPC connections only once idle (SLUICE_GRPC_MAX_CONNECTION_IDLE_S).",
    ),
    TritonFlag(
        "grpc-restricted-protocol",
        "text",
        "mapped",
        "SLUICE_GRPC_RESTRICTED_PROTOCOL (repeatable): the methods of the categories named "
        "answer UNAVAILABLE without the triton-grpc-protocol-<header> metadata.",
        _restricted("SLUICE_GRPC_RESTRICTED_PROTOCOL"),
    ),
    # SageMaker and Vertex AI
    TritonFlag(
        "allow-sagemaker",
        "bool",
        "refused",
        "Sluice has no SageMaker endpoint; serve SageMaker from Triton.",
        fine=_is(False),
    ),
    TritonFlag("sagemaker-port", "int", "ignored", "Sluice has no SageMaker endpoint."),
    TritonFlag("sagemaker-safe-port-range", "text", "ignored", "Sluice has no SageMaker endpoint."),
    TritonFlag("sagemaker-thread-count", "int", "ignored", "Sluice has no SageMaker endpoint."),
    TritonFlag(
        "allow-vertex-ai",
        "bool",
        "refused",
        "Sluice has no Vertex AI endpoint; serve Vertex AI from Triton.",
        fine=_is(False),
    ),
    TritonFlag("vertex-ai-port", "int", "ignored", "Sluice has no Vertex AI endpoint."),
    TritonFlag("vertex-ai-thread-count", "int", "ignored", "Sluice has no Vertex AI endpoint."),
    TritonFlag("vertex-ai-default-model", "text", "ignored", "Sluice has no Vertex AI endpoint."),
    # Metrics
    TritonFlag(
        "allow-client-shm",
        "bool",
        "mapped",
        "SLUICE_ALLOW_CLIENT_SHM: whether clients may register shared memory regions.",
        _env_bool("SLUICE_ALLOW_CLIENT_SHM"),
    ),
    TritonFlag(
        "allow-metrics",
        "bool",
        "mapped",
        "SLUICE_ALLOW_METRICS; false also closes the metrics port (metrics_port 0), "
        "whatever --metrics-port says, and GET /metrics answers 404.",
        _allow_metrics,
    ),
    TritonFlag(
        "allow-gpu-metrics",
        "bool",
        "ignored",
        "Sluice's GPU metrics follow --allow-metrics alone.",
        fine=_is(True),
    ),
    TritonFlag(
        "allow-cpu-metrics",
        "bool",
        "ignored",
        "Sluice's host metrics follow --allow-metrics alone.",
        fine=_is(True),
    ),
    TritonFlag(
        "metrics-address",
        "text",
        "mapped",
        "accepted when it is the HTTP address (--http-address), which Sluice serves metrics "
        "on; another address is refused.",
        _address,
    ),
    TritonFlag("metrics-port", "int", "option", "Sluice's option."),
    TritonFlag(
        "metrics-interval-ms",
        "float",
        "ignored",
        "Sluice computes its metrics when they are scraped.",
    ),
    TritonFlag(
        "metrics-config",
        "text",
        "ignored",
        "Sluice's metrics take no settings (latencies are histograms); one warning per setting.",
        _metrics_config,
    ),
    # Tracing
    TritonFlag(
        "trace-config",
        "text",
        "mapped",
        "opentelemetry,url=URL is SLUICE_OTLP_ENDPOINT (without /v1/traces) and "
        "opentelemetry,resource=service.name=NAME is OTEL_SERVICE_NAME; Sluice then traces "
        "every request. Other settings are ignored, one warning each.",
        _trace_config,
    ),
    TritonFlag(
        "trace-file",
        "text",
        "ignored",
        "Sluice exports traces with OpenTelemetry (--trace-config opentelemetry,url=...).",
    ),
    TritonFlag(
        "trace-level",
        "text",
        "ignored",
        "Sluice traces every request while an OpenTelemetry endpoint is set.",
    ),
    TritonFlag(
        "trace-rate",
        "int",
        "ignored",
        "Sluice traces every request while an OpenTelemetry endpoint is set.",
    ),
    TritonFlag(
        "trace-count",
        "int",
        "ignored",
        "Sluice traces every request while an OpenTelemetry endpoint is set.",
    ),
    TritonFlag(
        "trace-log-frequency",
        "int",
        "ignored",
        "Sluice exports traces with OpenTelemetry (--trace-config opentelemetry,url=...).",
    ),
    # Backends, repository agents, caches
    TritonFlag("backend-directory", "text", "ignored", "Sluice's backends are Python packages."),
    TritonFlag(
        "backend-config",
        "text",
        "ignored",
        "Sluice's backends take no such settings: one warning per setting, but for "
        "default-max-batch-size (global or onnxruntime's), which is "
        "SLUICE_DEFAULT_MAX_BATCH_SIZE, the max_batch_size of autocompleted models.",
        _backend_config,
    ),
    TritonFlag(
        "repoagent-directory",
        "text",
        "ignored",
        "Sluice loads no agent libraries: it carries out Triton's checksum agent itself.",
    ),
    TritonFlag(
        "cache-config",
        "text",
        "mapped",
        "local,size=<bytes> is SLUICE_RESPONSE_CACHE_BYTES, the room of the response cache "
        "(kept in the deployment's Redis for every gateway); redis,<setting>=<value> turns "
        "the same cache on (256 MiB unless local,size says), its settings ignored.",
        _cache_config,
    ),
    TritonFlag("cache-directory", "text", "ignored", "Sluice's response cache lives in Redis."),
    TritonFlag(
        "response-cache-byte-size",
        "int",
        "mapped",
        "SLUICE_RESPONSE_CACHE_BYTES (Triton's older spelling of --cache-config local,size).",
        _cache_bytes,
    ),
    # Rate limiter
    TritonFlag(
        "rate-limit",
        "text",
        "mapped",
        "SLUICE_RATE_LIMIT (off or execution_count): instances whose group lists "
        "rate_limiter resources hold them while they compute.",
        _rate_limit,
    ),
    TritonFlag(
        "rate-limit-resource",
        "text",
        "mapped",
        "SLUICE_RATE_LIMIT_RESOURCES (repeatable; <name>:<count>[:<device>], joined by ','): "
        "the copies of a rate limiter resource.",
        _rate_limit_resource,
    ),
    # Memory and devices
    TritonFlag("pinned-memory-pool-byte-size", "int", "ignored", _IGNORED_TUNING + "."),
    TritonFlag("cuda-memory-pool-byte-size", "text", "ignored", _IGNORED_TUNING + "."),
    TritonFlag("cuda-virtual-address-size", "text", "ignored", _IGNORED_TUNING + "."),
    TritonFlag(
        "min-supported-compute-capability",
        "float",
        "ignored",
        "Sluice places instances on the GPUs CUDA_VISIBLE_DEVICES shows; hide the others.",
    ),
    TritonFlag("buffer-manager-thread-count", "int", "ignored", _IGNORED_TUNING + "."),
    TritonFlag(
        "enable-peer-access",
        "bool",
        "ignored",
        "each worker process uses one GPU, and CUDA peer access is never asked for.",
        fine=_is(False),
    ),
    TritonFlag(
        "host-policy",
        "text",
        "ignored",
        "Sluice's workers are processes; bind them with the operating system (taskset, "
        "numactl, cgroups).",
    ),
    TritonFlag(
        "model-load-gpu-limit",
        "text",
        "ignored",
        "Sluice does not check GPU memory before a load; a load that does not fit fails "
        "with the reason.",
    ),
    # Deprecated in Triton
    TritonFlag(
        "strict-model-config",
        "bool",
        "ignored",
        "Sluice always completes a missing or partial configuration from the model file.",
        fine=_is(False),
    ),
)

FLAGS: dict[str, TritonFlag] = {flag.name: flag for flag in FLAGS_LIST}


# --- parsing ------------------------------------------------------------------------------


def _no_such_option(option: str, known: Iterable[str]) -> FlagError:
    """Click's words for an unknown option, with the close names of Sluice and Triton."""
    close = difflib.get_close_matches(option, sorted(set(known)), n=3, cutoff=0.8)
    hint = f" Did you mean {' or '.join(close)}?" if close else ""
    return FlagError(f"No such option: {option}{hint}")


def parse(args: Sequence[str], sluice_options: Iterable[str] = ()) -> TritonArgs:
    """What Triton's flags in ``args`` (what ``sluice up``'s own options left) ask for.
    ``sluice_options``: the names of ``sluice up``'s options, offered when a name is mistyped."""
    out = TritonArgs()
    known = [*sluice_options, *(flag.option for flag in FLAGS_LIST)]
    index = 0
    while index < len(args):
        token = args[index]
        index += 1
        if token.startswith("-") and not token.startswith("--") and len(token) > 1:
            raise _no_such_option(token.partition("=")[0], known)
        if not token.startswith("--") or token == "--":
            raise FlagError(f"Got unexpected extra argument ({token})")
        name, equals, text = token[2:].partition("=")
        flag = FLAGS.get(name)
        if flag is None or flag.kind == "option":
            raise _no_such_option(f"--{name}", known)
        if flag.value == "none":
            if equals:
                raise bad_value(flag, f"takes no value, got {text!r}")
        elif not equals:
            if index >= len(args):
                raise FlagError(f"Option '{flag.option}' requires a value.")
            text = args[index]
            index += 1
        _take(flag, text, out)
    return out


def _take(flag: TritonFlag, text: str, out: TritonArgs) -> None:
    if flag.apply is None:  # what applies a value checks it, as its own flag reads it
        _VALUE_CHECKS[flag.value](flag, text)
    if flag.fine is not None and flag.fine(text):
        return
    if flag.apply is not None:
        flag.apply(flag, text, out)
    elif flag.kind == "refused":
        shown = f"{flag.option}={text}" if flag.value != "none" else flag.option
        raise FlagError(f"{shown} is refused: {flag.does}")
    elif flag.kind == "ignored":
        out.warnings.append(f"warning: {flag.option} ignored: {flag.does}")
