"""What each mapped flag of Triton's does: the ``apply`` of its :class:`TritonFlag`, which
records the setting or ``SLUICE_*`` variable its value asks for."""

from __future__ import annotations

from collections.abc import Callable

from sluice.cli.triton_flags.values import (
    FALSE_TEXTS,
    TRUE_TEXTS,
    TritonArgs,
    TritonFlag,
    bad_value,
    parse_bool,
    parse_int,
)
from sluice.core.rate_limit import MODES, parse_resource_counts
from sluice.core.repository import CONFIG_NAME
from sluice.core.request_parameters import PatternError, forward_pattern
from sluice.core.restricted_api import parse_restrictions

_DEFAULT_MAX_BATCH_SIZE = "SLUICE_DEFAULT_MAX_BATCH_SIZE"
_AUTOCOMPLETING_BACKENDS = ("", "onnxruntime")
"""The backends whose models Sluice completes from the model file ("": every backend)."""


def means(wanted: bool) -> Callable[[str], bool]:
    """Values of a bool flag that mean ``wanted``."""
    return lambda text: text.strip().lower() in (TRUE_TEXTS if wanted else FALSE_TEXTS)


# --- what mapped flags do ----------------------------------------------------------------


def env_bool(variable: str) -> Callable[[TritonFlag, str, TritonArgs], None]:
    def apply(flag: TritonFlag, text: str, out: TritonArgs) -> None:
        out.environment[variable] = "true" if parse_bool(flag, text) else "false"

    return apply


def env_text(variable: str) -> Callable[[TritonFlag, str, TritonArgs], None]:
    def apply(_flag: TritonFlag, text: str, out: TritonArgs) -> None:
        out.environment[variable] = text

    return apply


def env_count(variable: str) -> Callable[[TritonFlag, str, TritonArgs], None]:
    """A whole number, 0 or more."""

    def apply(flag: TritonFlag, text: str, out: TritonArgs) -> None:
        number = parse_int(flag, text)
        if number < 0:
            raise bad_value(flag, f"{text}: a whole number, 0 or more")
        out.environment[variable] = str(number)

    return apply


def env_seconds_from_ms(variable: str) -> Callable[[TritonFlag, str, TritonArgs], None]:
    """Triton's milliseconds as Sluice's seconds (more than 0)."""

    def apply(flag: TritonFlag, text: str, out: TritonArgs) -> None:
        milliseconds = parse_int(flag, text)
        if milliseconds <= 0:
            raise bad_value(flag, f"{text}: milliseconds, more than 0")
        out.environment[variable] = f"{milliseconds / 1000:g}"

    return apply


def log_verbose(flag: TritonFlag, text: str, out: TritonArgs) -> None:
    lowered = text.strip().lower()
    level = {"true": 1, "false": 0}.get(lowered)
    if level is None:
        level = parse_int(flag, text)
    if level < 0:
        raise bad_value(flag, f"{text}: a level of 0 or more (or true / false)")
    out.environment["SLUICE_LOG_VERBOSE_LEVEL"] = str(level)


_LOG_FORMATS = {"default": "text", "iso8601": "iso8601"}


def log_format(flag: TritonFlag, text: str, out: TritonArgs) -> None:
    fmt = _LOG_FORMATS.get(text.strip().lower())
    if fmt is None:
        raise bad_value(flag, f"invalid argument for --log-format: {text} (default or ISO8601)")
    out.environment["SLUICE_LOG_FORMAT"] = fmt


def exit_timeout(flag: TritonFlag, text: str, out: TritonArgs) -> None:
    seconds = parse_int(flag, text)
    if seconds < 1:
        out.warnings.append(
            f"warning: {flag.option}={text}: Sluice's gateways wait at least 1 s for "
            "in-flight requests; waiting 1 s"
        )
        seconds = 1
    out.environment["SLUICE_SHUTDOWN_TIMEOUT_S"] = str(seconds)
    out.environment["SLUICE_WORKER_STOP_GRACE_S"] = str(seconds)


def exit_on_error(flag: TritonFlag, text: str, out: TritonArgs) -> None:
    out.overrides["exit_on_error"] = parse_bool(flag, text)


def poll_secs(flag: TritonFlag, text: str, out: TritonArgs) -> None:
    seconds = parse_int(flag, text)
    if seconds < 1:
        raise bad_value(flag, f"{text}: seconds between polls, 1 or more")
    out.overrides["repository_poll_s"] = float(seconds)


def header_pattern(variable: str) -> Callable[[TritonFlag, str, TritonArgs], None]:
    def apply(flag: TritonFlag, text: str, out: TritonArgs) -> None:
        try:
            forward_pattern(text)
        except PatternError as exc:
            raise bad_value(flag, f"{text!r} is not a regular expression: {exc}") from None
        out.environment[variable] = text

    return apply


def restricted(variable: str) -> Callable[[TritonFlag, str, TritonArgs], None]:
    """A restricted-API group (repeatable: the groups join with ';')."""

    def apply(flag: TritonFlag, text: str, out: TritonArgs) -> None:
        joined = ";".join(filter(None, (out.environment.get(variable, ""), text)))
        try:
            parse_restrictions(joined)
        except ValueError as exc:
            raise bad_value(flag, str(exc)) from None
        out.environment[variable] = joined

    return apply


def rate_limit(flag: TritonFlag, text: str, out: TritonArgs) -> None:
    mode = text.strip().lower()
    if mode not in MODES:
        raise bad_value(flag, f"invalid value for rate limit mode: {text} (off, execution_count)")
    out.environment["SLUICE_RATE_LIMIT"] = mode


def rate_limit_resource(flag: TritonFlag, text: str, out: TritonArgs) -> None:
    """One resource's count (repeatable: the counts join with ',')."""
    try:
        parse_resource_counts(text)
    except ValueError as exc:
        raise bad_value(flag, str(exc)) from None
    variable = "SLUICE_RATE_LIMIT_RESOURCES"
    out.environment[variable] = ",".join(filter(None, (out.environment.get(variable), text)))


def load_retries(flag: TritonFlag, text: str, out: TritonArgs) -> None:
    retries = parse_int(flag, text)
    if not 0 <= retries <= 100:
        raise bad_value(flag, f"{text}: retries of a failed load, 0 to 100")
    out.overrides["model_load_retry_count"] = retries


def model_config_name(flag: TritonFlag, text: str, out: TritonArgs) -> None:
    if not CONFIG_NAME.fullmatch(text):
        raise bad_value(
            flag,
            f"{text!r}: the name of a file in each model's configs/ folder, without '.pbtxt' "
            "(letters, digits, '_', '.', '-'; no space)",
        )
    out.environment["SLUICE_MODEL_CONFIG_NAME"] = text


def allow_grpc(flag: TritonFlag, text: str, out: TritonArgs) -> None:
    if not parse_bool(flag, text):
        out.overrides["grpc_port"] = 0


def allow_metrics(flag: TritonFlag, text: str, out: TritonArgs) -> None:
    allowed = parse_bool(flag, text)
    out.environment["SLUICE_ALLOW_METRICS"] = "true" if allowed else "false"
    if not allowed:
        out.overrides["metrics_port"] = 0


def address(flag: TritonFlag, text: str, out: TritonArgs) -> None:
    out.addresses[flag.name] = text


_COMPRESSION = {"none": "none", "low": "gzip", "medium": "gzip", "high": "gzip"}


def compression(flag: TritonFlag, text: str, out: TritonArgs) -> None:
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


def backend_config(flag: TritonFlag, text: str, out: TritonArgs) -> None:
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


def cache_config(flag: TritonFlag, text: str, out: TritonArgs) -> None:
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


def cache_bytes(flag: TritonFlag, text: str, out: TritonArgs) -> None:
    size = parse_int(flag, text)
    if size < 0:
        raise bad_value(flag, f"{text}: a number of bytes, 0 or more")
    out.environment[_CACHE_BYTES] = str(size)


def metrics_config(flag: TritonFlag, text: str, out: TritonArgs) -> None:
    _group, setting, _value = _setting(flag, text, group_required=False)
    out.warnings.append(
        f"warning: {flag.option}={text} ignored: Sluice's metrics take no setting "
        f"'{setting}' (they are computed when scraped, as histograms)"
    )


_TRACES_PATH = "/v1/traces"


def trace_config(flag: TritonFlag, text: str, out: TritonArgs) -> None:
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
