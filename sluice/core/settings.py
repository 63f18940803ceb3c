"""Typed settings, one class per process role, read from ``SLUICE_*`` variables.

Settings objects are built once at process start (by the CLI) and passed down
explicitly; nothing else reads the environment.
"""

from __future__ import annotations

import json
import os
import re
import socket
import sys
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

from pydantic import AliasChoices, Field, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from sluice.core.errors import StartupFailed
from sluice.core.memory_budget import parse_gpu_budgets, parse_size
from sluice.core.rate_limit import parse_resource_counts
from sluice.core.request_parameters import PatternError, forward_pattern
from sluice.core.restricted_api import parse_restrictions
from sluice.core.torchserve.ports import parse_ports

MIB = 1 << 20
GIB = 1 << 30

S = TypeVar("S", bound=BaseSettings)


_SECRETS = frozenset(("api_keys", "admin_keys", "http_restricted_api", "grpc_restricted_protocol"))
"""Settings whose values are never shown in an error."""


def settings_problems(exc: ValidationError) -> str:
    """What is wrong with the settings, one clause per bad value, each naming its
    ``SLUICE_*`` variable and the value given (options of the command line that set the
    same field are named by the variable too)."""
    clauses = []
    for error in exc.errors():
        field = "_".join(str(part) for part in error["loc"] if isinstance(part, str))
        name = f"SLUICE_{field.upper()}" if field else "the settings"
        message = str(error["msg"]).removeprefix("Value error, ")
        shown = "<hidden>" if field in _SECRETS else repr(error.get("input"))
        clauses.append(f"invalid setting {name}={shown}: {message}")
    return "; ".join(clauses)


def read_settings(kind: type[S], **values: Any) -> S:
    """``kind`` from ``values`` and the ``SLUICE_*`` variables; a bad value is a
    :class:`StartupFailed` naming it (``error: invalid setting SLUICE_...``, exit status 2)
    instead of a traceback."""
    try:
        return kind(**values)
    except ValidationError as exc:
        raise StartupFailed(settings_problems(exc)) from None


def settings_at_start(kind: type[S]) -> S:
    """:func:`read_settings` for a service's ``python -m`` entry point: a bad value prints
    ``error: ...`` on stderr and exits with status 2."""
    try:
        return read_settings(kind)
    except StartupFailed as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        raise SystemExit(exc.exit_status) from None


AUTO_GATEWAY_PROCESSES_CAP = 16
"""``auto`` starts at most this many gateway processes: about a dozen busy ones carry what
one Redis core can (some 14 µs of Redis per request against 200 µs of gateway, see
bench/RESULTS.md), so more add memory (each has its own Redis clients, reply stream and
catalog copy) and refresh traffic, not requests per second."""


def auto_gateway_processes() -> int:
    """``--gateway-processes auto``: half the CPUs this process may run on, at least 1, at
    most :data:`AUTO_GATEWAY_PROCESSES_CAP`.

    Half, because the workers, Redis and the host's other work need the rest: a request
    costs the gateway about as much CPU as it costs all of them together. On two CPUs one
    gateway process served 3-6 % more requests a second than two at saturation, with a
    lower p99, and spent 15-25 % less CPU per request at 100 and 1,000 requests a second
    (bench/RESULTS.md, "How many gateway processes")."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return max(1, min(cpus // 2, AUTO_GATEWAY_PROCESSES_CAP))


def gateway_processes_value(value: object) -> object:
    """A number of gateway processes, or ``auto`` made one (a number is checked by the
    field's bounds); anything else is refused, naming the setting."""
    if isinstance(value, str):
        text = value.strip().lower()
        if text == "auto":
            return auto_gateway_processes()
        if not text.isdigit():
            raise ValueError(
                f"gateway_processes (--gateway-processes, SLUICE_GATEWAY_PROCESSES) must be "
                f"'auto' or a number from 1 to 64, got {value!r}"
            )
        return int(text)
    return value


def _regular_expression(value: str) -> str:
    """A forward pattern must compile (:func:`~sluice.core.request_parameters.forward_pattern`)."""
    try:
        forward_pattern(value)
    except PatternError as exc:
        raise ValueError(f"not a regular expression: {exc}") from None
    return value


def _restrictions_value(value: str) -> str:
    """A restricted-API setting must parse (:mod:`sluice.core.restricted_api`)."""
    parse_restrictions(value)
    return value


_INT32_MAX = (1 << 31) - 1
"""The largest value of a gRPC channel argument (a C ``int``: grpcio refuses more, and the
gateway would not start)."""
_GRPC_MAX_S = _INT32_MAX // 1000
"""The longest time in seconds that one in milliseconds holds."""

CONFIG_NAME_PATTERN = r"[A-Za-z0-9_.-]{0,128}"
"""A custom configuration's name (Triton's --model-config-name): a file name with no folder
and no space (Triton asks for no space); empty for none."""

DEFAULT_MAX_BATCH_SIZE = 4
"""The ``max_batch_size`` autocomplete gives a model that can batch (Triton's default for
``--backend-config=default-max-batch-size``)."""


class CommonSettings(BaseSettings):
    """What every process of one Sluice deployment must agree on."""

    model_config = SettingsConfigDict(env_prefix="SLUICE_", extra="ignore")

    redis_url: str = "redis://127.0.0.1:6379/0"
    """Redis that carries the request streams, reply streams and the model catalog. A Redis
    Cluster is named ``redis+cluster://host:port`` (or ``rediss+cluster://``): any node,
    the others are discovered (:mod:`sluice.core.redis_client.connect`)."""

    namespace: str = Field("sluice", pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    """Prefix of every Redis key, so that several deployments can share one Redis (letters,
    digits, ``_.-``: braces would move the keys' Redis Cluster hash tags)."""

    host_id: str = Field("", pattern=r"^[A-Za-z0-9_.:-]{0,64}$")
    """Which host this process is on, for shared memory (:mod:`sluice.core.hosts`); empty: derived
    from the kernel's boot id and this process's /dev/shm."""

    batch_broker_url: str = ""
    """Celery broker of the offline batch jobs; empty: the deployment's Redis. Celery's Redis
    transport does not speak Redis Cluster, so a deployment on a cluster names a plain Redis
    here to run batch jobs."""

    allow_metrics: bool = True
    """As Triton's --allow-metrics: False turns off ``GET /metrics`` and the latency
    histograms the workers keep for it (the statistics extension's counters stay)."""

    log_format: Literal["text", "iso8601", "json", "auto"] = "text"
    """``text``: human-readable lines; ``iso8601``: the same with UTC ISO 8601 times;
    ``json``: one JSON object per line (time, level, logger, message, role, pid, and
    request_id / trace_id when known); ``auto``: text on a terminal, JSON otherwise."""

    log_file: str = ""
    """Append log lines to this file instead of standard error (Triton's --log-file)."""

    log_verbose_level: int = Field(0, ge=0)
    """As Triton's --log-verbose: 0 logs INFO and above, 1 or more adds debug messages."""

    log_info: bool = True
    """As Triton's --log-info: whether INFO messages are logged."""

    log_warning: bool = True
    """As Triton's --log-warning: whether WARNING messages are logged."""

    log_error: bool = True
    """As Triton's --log-error: whether ERROR messages are logged."""

    otlp_endpoint: str = Field(
        "", validation_alias=AliasChoices("SLUICE_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
    )
    """OTLP/HTTP collector (e.g. ``http://collector:4318``): spans go to
    ``<endpoint>/v1/traces`` (needs the ``tracing`` extra). Empty: no tracing. Falls back
    to the standard OTEL_EXPORTER_OTLP_ENDPOINT."""

    otel_service_name: str = Field("sluice", validation_alias=AliasChoices("OTEL_SERVICE_NAME"))
    """The ``service.name`` of the exported spans (the standard OTEL_SERVICE_NAME)."""

    model_config_name: str = Field("", pattern=f"^{CONFIG_NAME_PATTERN}$")
    """Triton's --model-config-name: a model whose folder has ``configs/<name>.pbtxt`` is
    served with that configuration instead of its ``config.pbtxt`` (the others with theirs),
    so that hosts of different kinds share one repository. Empty: ``config.pbtxt`` alone."""

    default_max_batch_size: int = Field(DEFAULT_MAX_BATCH_SIZE, ge=0, le=2**31 - 1)
    """Triton's --backend-config=default-max-batch-size: the ``max_batch_size`` autocomplete
    gives an ONNX model without ``config.pbtxt`` whose inputs and outputs all have a
    variable first dimension (0: such models do not batch); over 1, with the dynamic
    batcher. Every process reads the repository with it, so all of a deployment's share it."""


class ApiKeySettings(BaseSettings):
    """The API keys a gateway accepts, each belonging to a tenant
    (:mod:`sluice.core.tenants`)."""

    model_config = SettingsConfigDict(env_prefix="SLUICE_", extra="ignore")

    api_keys: str = Field("", repr=False)
    """Comma-separated ``tenant:key`` entries: bearer tokens accepted on every endpoint but
    management, each belonging to its tenant (a bare ``key`` is a tenant of its own, see
    :mod:`sluice.core.tenants`). With no key at all (here or in ``admin_keys``) every endpoint is
    open to one tenant, ``anonymous``."""

    api_keys_file: str = ""
    """File with one ``tenant:key`` entry per line (added to ``api_keys``)."""

    admin_keys: str = Field("", repr=False)
    """Comma-separated ``tenant:key`` entries (a bare ``key``: tenant ``admin``) accepted on
    every endpoint, management included (repository, model control, shared memory, logging,
    trace, TorchServe's management API). Whenever any key is set, management needs one."""

    admin_keys_file: str = ""
    """File with one admin ``tenant:key`` entry per line (added to ``admin_keys``)."""

    def inference_keys(self) -> list[str]:
        """``api_keys`` and the lines of ``api_keys_file``; OSError if it cannot be read."""
        return _keys(self.api_keys, self.api_keys_file)

    def admin_key_list(self) -> list[str]:
        """``admin_keys`` and the lines of ``admin_keys_file``; OSError if it cannot be read."""
        return _keys(self.admin_keys, self.admin_keys_file)


def torchserve_ports_value(value: str) -> str:
    """``torchserve_ports`` checked (:func:`sluice.core.torchserve.ports.parse_ports`)."""
    parse_ports(value)
    return value


def _keys(inline: str, file: str) -> list[str]:
    keys = [key.strip() for key in inline.split(",") if key.strip()]
    if file:
        keys += [line.strip() for line in Path(file).read_text().splitlines() if line.strip()]
    return keys


def _default_cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return str(Path(base) / "sluice" / "repositories")


def repository_locations(value: object) -> object:
    """The model repositories a setting names: one location (``/models``,
    ``s3://bucket/prefix``), or several as a JSON list (``["/a", "s3://b/c"]``), as Triton
    takes ``--model-repository`` more than once. The same location named twice counts once;
    an empty value names none."""
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("["):
            try:
                value = json.loads(text)
            except ValueError as exc:
                raise ValueError(f"not a JSON list of locations: {exc}") from None
        else:
            value = [text] if text else []
    if isinstance(value, (list, tuple)):
        if not all(isinstance(item, str) and item.strip() for item in value):
            raise ValueError("every model repository must be a non-empty string")
        return tuple(dict.fromkeys(item.strip() for item in value))
    return value


def locations_text(locations: tuple[str, ...]) -> str:
    """``locations`` as a ``SLUICE_MODEL_REPOSITORY`` value that :func:`repository_locations`
    reads back: one location as it is, several as a JSON list."""
    return locations[0] if len(locations) == 1 else json.dumps(list(locations))


RepositoryLocations = Annotated[tuple[str, ...], NoDecode]
"""A setting naming model repositories (see :func:`repository_locations`)."""


class RepositorySourceSettings(BaseSettings):
    """Where a model repository comes from when it is not a local directory
    (``s3://bucket/prefix``), and the limits put on what the store sends."""

    model_config = SettingsConfigDict(env_prefix="SLUICE_", extra="ignore")

    repository_cache_dir: str = Field(default_factory=_default_cache_dir)
    """Local copies of remote repositories, one folder per repository URL (default
    ``$XDG_CACHE_HOME/sluice/repositories``, else ``~/.cache/sluice/repositories``)."""

    repository_poll_s: float = Field(15.0, gt=0)
    """How often a repository is listed again for changes (Triton's --repository-poll-secs)."""

    model_namespacing: bool = False
    """Triton's --model-namespacing: with several repositories, each is a namespace, and
    two of them may hold models of the same name (each served; a request naming the name
    alone is refused as ambiguous; an ensemble calls the model of its own repository).
    False: a name two repositories hold is served from neither. Gateways answer an unknown
    name 400 with it, as Triton: one started apart from ``sluice up`` needs it too."""

    s3_endpoint_url: str = ""
    """S3-compatible endpoint (MinIO, Ceph, ...): ``http://host:9000``; empty: AWS (or the
    standard AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL)."""

    s3_region: str = ""
    """Region of the bucket; empty: the standard AWS chain (AWS_REGION, ~/.aws/config)."""

    s3_max_object_bytes: int = Field(8 * GIB, ge=1)
    """Largest object taken from the store; a version holding a larger one is refused."""

    s3_max_version_bytes: int = Field(32 * GIB, ge=1)
    """Largest model version taken (its files and the model's own files together)."""

    s3_max_objects: int = Field(100_000, ge=1)
    """Most objects under the repository prefix; beyond it the listing is refused."""

    s3_timeout_s: float = Field(60.0, gt=0)
    """Connect and read timeout of each request to the store."""

    s3_attempts: int = Field(5, ge=1, le=20)
    """Tries per request (and per object download) before the error is reported."""


def _default_batch_store() -> str:
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return str(Path(base) / "sluice" / "batches")


class BatchStoreSettings(RepositorySourceSettings):
    """Where batch data lives and which locations a tenant's batch jobs may name: what the
    gateway (uploads, downloads, checks at submission) and the batch worker (reads, writes,
    expiry) must agree on. The repository source settings come along: the S3 client's, and
    the repository cache, where no batch job may read or write."""

    batch_store: str = ""
    """Where uploads and batch outputs are kept: a directory or ``s3://bucket/prefix/``,
    one area per tenant (``<store>/<tenant>/uploads/...``, ``<store>/<tenant>/batches/<id>/``).
    Empty: no uploads, and every batch job must name an output location it is allowed.
    ``sluice up`` sets it to ``$XDG_DATA_HOME/sluice/batches`` (else
    ``~/.local/share/sluice/batches``) unless it is set."""

    batch_root: str = ""
    """An operator's directory whose local paths every tenant's batch jobs may read and
    write (after following links); empty: none. Not set by ``sluice up``."""

    batch_allowed_locations: str = ""
    """Server paths and ``s3://`` locations a tenant's batch jobs may name as input or
    output: comma-separated ``tenant=regex`` (``*=regex``: every tenant), each regex
    matched against the whole location. None by default: tenants upload their data and
    download their outputs through the gateway."""

    @field_validator("batch_allowed_locations")
    @classmethod
    def _rules_parse(cls, value: str) -> str:
        for rule in (r.strip() for r in value.split(",")):
            if not rule:
                continue
            tenant, equals, pattern = rule.partition("=")
            if not equals or not tenant.strip() or not pattern.strip():
                raise ValueError(f"{rule[:80]!r} is not 'tenant=regex' (or '*=regex')")
            try:
                re.compile(pattern.strip())
            except re.error as exc:
                raise ValueError(f"{pattern!r} is not a regular expression: {exc}") from None
        return value

    model_repository: RepositoryLocations = ()
    """The model repositories (directories or ``s3://bucket/prefix``, several as a JSON
    list): no batch job may read or write inside them. ``sluice up`` passes its own."""

    _locations = field_validator("model_repository", mode="before")(repository_locations)

    batch_retention_s: float = Field(7 * 86_400.0, gt=0)
    """How long a finished batch job (its record, listing entry and outputs in the store)
    is kept."""

    upload_retention_s: float = Field(86_400.0, gt=0)
    """How long an upload is kept; one a batch job uses is kept as long as that job."""

    tenant_max_stored_bytes: int = Field(50 * GIB, ge=1)
    """Bytes one tenant may keep in the store (uploads and batch outputs together, each
    output counted before it is written); at it, uploads, new batch jobs and resumes get
    429 + Retry-After, and a running job whose next output would pass it stops (failed,
    its committed shards kept)."""

    max_batch_input_bytes: int = Field(8 * GIB, ge=1)
    """Largest ``s3://`` input of one batch job, checked before and while downloading."""

    tenant_max_running_batches: int = Field(4, ge=1, le=100_000)
    """Batch jobs one tenant has running at once (planning or running); a job submitted or
    resumed beyond it is accepted and waits ``queued``, in order, and starts as one of the
    tenant's running jobs ends. Each running job keeps up to ``SLUICE_BATCH_SHARDS_IN_FLIGHT``
    shard tasks in the batch queue, so 4 bounds a tenant's part of that queue at 64 tasks
    (about 64 KiB of Redis, where 10,000 running jobs took 160 MB) and at four times the
    turns of a tenant with one job, while a tenant of small jobs (fewer shards than a
    window) still keeps the batch workers busy between the end of one job and the planning
    of the next. Every gateway and batch worker of a deployment must use the same value."""

    store_sweep_s: float = Field(60.0, gt=0)
    """How often each batch worker and gateway process removes expired uploads and batch
    jobs (with their files)."""


class ResponseCacheSettings(BaseSettings):
    """Triton's response cache (:mod:`sluice.core.response_cache`): the gateways answer
    clients' requests from it, the workers their models' calls (ensemble steps, BLS)."""

    model_config = SettingsConfigDict(env_prefix="SLUICE_", extra="ignore")

    response_cache_bytes: int = Field(0, ge=0)
    """Room for the answers of models whose configuration enables Triton's
    ``response_cache``, kept in Redis for every gateway and worker (0: no cache, as Triton
    without ``--cache-config``). The least recently used answers go when a new one needs
    room."""

    response_cache_ttl_s: float = Field(3600.0, gt=0, le=31_536_000)
    """How long a cached answer is kept after it was last used (at most a year: Redis
    refuses an expiry far beyond that, and then would keep nothing)."""

    response_cache_shards: int = Field(0, ge=0, le=1024)
    """How many Redis Cluster slots the cache spreads over, each shard with an equal part of
    the room and a least-recently-used order of its own, so that the lookups of a cached
    model spread over the cluster's nodes (an answer larger than one part is not kept). 0:
    one on a single Redis, 16 on a Redis Cluster. Every gateway and worker of a deployment
    must use the same count."""


class GatewaySettings(BatchStoreSettings, ApiKeySettings, ResponseCacheSettings, CommonSettings):
    """Settings of a gateway process: its listeners (HTTP, gRPC, metrics), the limits it puts
    on clients, and asynchronous jobs."""

    http_host: str = "127.0.0.1"
    """Address the HTTP server binds to."""

    http_port: int = Field(8000, ge=0, le=65535)
    """Port of the KServe v2 / Triton-compatible HTTP API."""

    gateway_processes: int = Field(1, ge=1, le=64)
    """Gateway processes sharing the port (set by ``sluice up``, see UpSettings; ``auto``:
    one per two CPUs this process may run on)."""

    _gateway_processes_auto = field_validator("gateway_processes", mode="before")(
        gateway_processes_value
    )

    grpc_port: int = Field(8001, ge=0, le=65535)
    """Port of the KServe v2 / Triton gRPC API, on ``http_host`` (Triton's 8001; 0: none)."""

    torchserve_metrics: bool = False
    """Also write TorchServe's Prometheus names for the inference counters on /metrics
    (``ts_inference_requests_total`` and the two latency counters)."""

    torchserve_ports: str = ""
    """TorchServe's inference, management and metrics ports (its ``8080,8081,8082``),
    comma-separated, each ``port`` (on ``http_host``) or ``host:port``; 0 leaves one out,
    empty serves none. Each answers only its own API, as TorchServe's do
    (:mod:`sluice.core.torchserve.ports`)."""

    _torchserve_ports_valid = field_validator("torchserve_ports")(torchserve_ports_value)

    torchserve_fds: str = ""
    """Set by ``sluice up``: the listening sockets of ``torchserve_ports`` it opened,
    inherited, in the same order (-1 for a port left out)."""

    allowed_model_urls: str = ""
    """URLs ``POST /models?url=`` may download archives from: regular expressions,
    comma-separated, each matched against the whole URL (TorchServe's ``allowed_urls``;
    none by default, where TorchServe allows every URL)."""

    @field_validator("allowed_model_urls")
    @classmethod
    def _patterns_compile(cls, value: str) -> str:
        for pattern in (p.strip() for p in value.split(",")):
            if pattern:
                try:
                    re.compile(pattern)
                except re.error as exc:
                    raise ValueError(f"{pattern!r} is not a regular expression: {exc}") from None
        return value

    model_store: Path | None = None
    """TorchServe's model store: the folder whose archives (``.mar``, ``.tar.gz``, or an
    unarchived model folder) ``POST /models?url=`` registers (TorchServe's
    ``--model-store``; unset: registering is refused)."""

    workflow_store: Path | None = None
    """TorchServe's workflow store: the folder whose workflow archives (``.war``)
    ``POST /workflows?url=`` registers (TorchServe's ``--workflow-store``; unset: the model
    store)."""

    grpc_reuse_port: bool = False
    """Bind the gRPC port with SO_REUSEPORT, shared by the gateway processes of one
    ``sluice up`` (which sets it, having made sure no other server holds the port)."""

    grpc_max_receive_message_bytes: int | None = Field(None, ge=1024, le=(1 << 31) - 1)
    """Largest gRPC request message (gRPC's max_receive_message_length); beyond it the call
    fails with RESOURCE_EXHAUSTED. Unset: ``max_body_bytes``, so that one setting bounds
    HTTP bodies and gRPC messages alike."""

    grpc_max_send_message_bytes: int = Field((1 << 31) - 1, ge=1024, le=(1 << 31) - 1)
    """Largest gRPC response message (gRPC's max_send_message_length; Triton's default)."""

    http_restricted_api: str = Field("", repr=False)
    """Triton's --http-restricted-api: groups ``<category>[,...]:<header>=<value>`` joined
    by ``;``; an endpoint of a listed category (Triton's: health, metadata, inference,
    shared-memory, model-config, model-repository, statistics, trace, logging) answers 403
    unless the request has that header with that value. Beside the API keys, not instead."""

    grpc_restricted_protocol: str = Field("", repr=False)
    """Triton's --grpc-restricted-protocol: the same for gRPC methods, the header sent as
    ``triton-grpc-protocol-<header>`` metadata (UNAVAILABLE without it, as in Triton)."""

    _restrictions = field_validator("http_restricted_api", "grpc_restricted_protocol")(
        _restrictions_value
    )

    http_header_forward_pattern: str = ""
    """Triton's --http-header-forward-pattern: request headers whose names match this
    regular expression (RE2's syntax, as in Triton; anywhere in the name, ignoring case
    unless the pattern says ``(?-i)``) become string parameters of each inference
    request; Authorization never does. Empty: none."""

    grpc_header_forward_pattern: str = ""
    """Triton's --grpc-header-forward-pattern: the same for gRPC metadata."""

    _forward_patterns = field_validator(
        "http_header_forward_pattern", "grpc_header_forward_pattern"
    )(_regular_expression)

    grpc_response_compression: Literal["none", "gzip", "deflate"] = "none"
    """Compression of gRPC responses (requests are accepted compressed or not, as the
    client chooses)."""

    grpc_stream_max_in_flight: int = Field(256, ge=1, le=65536)
    """Requests of one ModelStreamInfer stream under way at once, and answers of the stream
    waiting for its client to read them; the stream reads no further until one is answered
    and read (flow control reaches the client)."""

    grpc_max_streams_per_connection: int = Field(100, ge=1, le=65536)
    """Calls one gRPC connection may have open at once (HTTP/2's
    SETTINGS_MAX_CONCURRENT_STREAMS): a client's further calls wait in its own channel."""

    grpc_max_concurrent_receives: int | None = Field(None, ge=1)
    """ModelInfer request messages one gateway process receives at once (gRPC reads a whole
    message before it can be looked at); a further call waits for its turn while HTTP/2
    flow control holds its bytes at the client. Unset: ``max_buffered_body_bytes`` divided
    by the receive limit (at least 1), so messages being received can never take more than
    that budget."""

    grpc_max_open_streams: int | None = Field(None, ge=1)
    """ModelStreamInfer streams one gateway process keeps open at once (each may have one
    message of up to the receive limit arriving); a further stream is refused with
    UNAVAILABLE. Unset: as ``grpc_max_concurrent_receives``."""

    grpc_tenant_max_open_streams: int | None = Field(None, ge=1)
    """ModelStreamInfer streams one tenant (an API key's) keeps open at once in one gateway
    process; a further one of that tenant's is refused with RESOURCE_EXHAUSTED, and other
    tenants' still open. Unset: half of ``grpc_max_open_streams`` (at least 1), so that one
    tenant's streams, idle ones included, cannot hold every place. The anonymous tenant of
    a deployment without API keys has the whole limit."""

    grpc_stream_idle_timeout_s: float = Field(300.0, gt=0)
    """A ModelStreamInfer stream that sends no request for this long, with none of its
    requests under way, is ended with DEADLINE_EXCEEDED, giving its place back."""

    grpc_keepalive_time_s: float = Field(60.0, gt=0, le=_GRPC_MAX_S)
    """How often the gateway pings a gRPC connection with calls open, to find dead peers
    (gRPC takes milliseconds in a 32-bit integer: at most about 24 days)."""

    grpc_keepalive_timeout_s: float = Field(20.0, gt=0, le=_GRPC_MAX_S)
    """A connection whose peer does not answer a ping within this time is closed (its
    calls end)."""

    grpc_max_connection_idle_s: float = Field(300.0, gt=0, le=_GRPC_MAX_S)
    """A gRPC connection without any call for this long is closed (GOAWAY; clients
    reconnect on their next call)."""

    grpc_keepalive_permit_without_calls: bool = False
    """Triton's --grpc-keepalive-permit-without-calls: clients may send keepalive pings on a
    connection without calls (and the gateway pings it too); false: such pings count as
    strikes (``grpc_http2_max_ping_strikes``)."""

    grpc_http2_min_recv_ping_interval_without_data_ms: int = Field(300_000, ge=0, le=_INT32_MAX)
    """Triton's --grpc-http2-min-recv-ping-interval-without-data: a client ping that comes
    sooner than this after the last one, with no data sent between, counts as a strike."""

    grpc_http2_max_ping_strikes: int = Field(2, ge=0, le=_INT32_MAX)
    """Triton's --grpc-http2-max-ping-strikes: a client past this many strikes is sent away
    (GOAWAY, ``too_many_pings``); 0: never."""

    model_control_timeout_s: float = Field(125.0, gt=0)
    """How long a load / unload request waits for ``sluice up`` to carry it out."""

    metrics_port: int = Field(0, ge=0, le=65535)
    """A second port that serves only ``GET /metrics``, as Triton's 8002 (0: none;
    ``/metrics`` is always served on the HTTP port too)."""

    metrics_fd: int = Field(-1, ge=-1)
    """An inherited listening socket for the metrics port (set by ``sluice up``)."""

    http_fd: int = Field(-1, ge=-1)
    """An already listening socket to serve on (set by ``sluice up``); -1 binds host:port."""

    max_body_bytes: int = Field(64 * MIB, ge=1)
    """Largest accepted request body (after decompression), as Triton's --http-max-input-size."""

    max_tensor_elements: int = Field(1 << 26, ge=1)
    """Largest element count of one input tensor."""

    default_timeout_s: float = Field(60.0, gt=0)
    """Deadline of a request whose client and model configuration give none."""

    catalog_refresh_s: float = Field(0.5, gt=0)
    """How often the gateway re-reads the model catalog and worker liveness from Redis."""

    catalog_idle_refresh_s: float = Field(2.0, gt=0, le=4.0)
    """How often it does so while no request arrives: an idle gateway costs a quarter as
    much. The first refresh after requests start again comes within ``catalog_refresh_s``;
    loads and unloads through another gateway process of the host, and requests for a
    model it does not know or knows as not ready, catch up at once. At most 4 s, so that
    its report (which lives 5 s) never lapses."""

    stream_max_len: int = Field(100_000, ge=100)
    """Approximate cap on each request stream's length (XADD MAXLEN ~); a safety net only,
    since workers delete entries once answered and admission control bounds the queue."""

    max_in_flight: int = Field(4096, ge=1)
    """Requests one gateway process holds at once; beyond it new requests get 503 + Retry-After."""

    default_max_queue_size: int = Field(2048, ge=0)
    """Queue limit of a model whose configuration sets no max_queue_size (0 = unbounded)."""

    redis_timeout_s: float = Field(2.0, gt=0)
    """Socket timeout of the gateway's Redis commands, so an unresponsive Redis fails fast."""

    max_header_count: int = Field(100, ge=1)
    """Most HTTP request headers accepted (431 beyond)."""

    max_header_bytes: int = Field(16384, ge=256)
    """Largest total size of HTTP request headers (431 beyond)."""

    max_buffered_body_bytes: int = Field(1024 * MIB, ge=1)
    """Request-body bytes one gateway process holds at once, all requests together (at
    least ``max_body_bytes``); beyond it new requests get 503 + Retry-After, so a flood of
    large bodies cannot exhaust the host's memory."""

    max_upload_bytes: int = Field(8 * GIB, ge=1)
    """Largest file ``POST /v2/uploads`` takes (streamed to the batch store; 413 beyond).
    The upload route has this limit instead of ``max_control_body_bytes``, and its body
    timeout counts from the last bytes received instead of from the headers."""

    tenant_max_uploads: int = Field(1000, ge=1)
    """Uploads one tenant keeps at once (arriving ones included), however small: each costs
    a record in Redis and a file in the store, so an empty one counts too. Beyond it, 429 +
    Retry-After until it deletes some or they expire."""

    tenant_max_batches: int = Field(10_000, ge=1)
    """Batch jobs one tenant keeps at once, running or finished (a finished one is kept
    ``batch_retention_s``): each costs records in Redis and a task in the batch queue.
    Beyond it, 429 + Retry-After until old ones expire."""

    max_control_body_bytes: int = Field(1 * MIB, ge=1)
    """Largest accepted request body on every route but inference (shared memory
    registration, repository): they carry small JSON documents."""

    header_timeout_s: float = Field(10.0, gt=0)
    """A connection must deliver a request's complete headers within this time of opening
    (or of its first byte, for the next request on a kept-alive connection); else 408."""

    body_timeout_s: float = Field(60.0, gt=0)
    """A request's complete body must arrive within this time after its headers. Only the
    time the server is reading counts: while it has stopped reading because what it holds
    is not yet taken (a busy server, flow control), the clock stops."""

    send_timeout_s: float = Field(60.0, gt=0)
    """A client that reads nothing of a pending response for this long is disconnected."""

    keep_alive_s: float = Field(5.0, gt=0)
    """An idle kept-alive connection is closed after this time."""

    max_connections: int = Field(4096, ge=1)
    """Open connections one gateway process accepts; beyond it new ones are closed at once
    (and requests on connections past uvicorn's concurrency limit get 503)."""

    job_queue_ttl_s: float = Field(86_400.0, gt=0)
    """How long an asynchronous job may wait for a worker before it expires (its request's
    ``timeout`` parameter may shorten it)."""

    job_retention_s: float = Field(86_400.0, gt=0)
    """How long a finished job and its result are kept."""

    max_queued_jobs: int = Field(100_000, ge=1)
    """Jobs one model version may have waiting; beyond: 503 + Retry-After."""

    tenant_max_queued_jobs: int = Field(10_000, ge=1)
    """Jobs one tenant may have waiting (submitted, not yet started by a worker) for one
    model; beyond: 429 + Retry-After for that tenant alone."""

    tenant_max_queued_job_bytes: int = Field(1 << 30, ge=1)
    """Bytes one tenant's waiting jobs of one model may hold in Redis (their queue entries);
    beyond: 429 + Retry-After for that tenant alone (413 for one job larger than this)."""

    tenant_max_job_result_bytes: int = Field(1 << 30, ge=1)
    """Bytes the answers of one tenant's finished jobs of one model may hold in Redis while
    they are kept (``job_retention_s``); once they hold as many, that tenant's new jobs of
    the model get 429 + Retry-After until some expire or are deleted (``DELETE
    /v2/jobs/{id}`` of a finished job frees its answer at once), and an answer that comes
    then is not kept (its job fails with that 429, read without Retry-After: it is final)."""

    tenant_limits_file: str = ""
    """TOML file of each tenant's share and limits (weight, rate and burst, max_in_flight,
    max_queued_bytes; see "Limits and shares per tenant" in the tenants documentation),
    re-read within a few seconds of a change, without a restart: a file that cannot be
    used is logged and counted, and the limits in force stay. When set,
    ``tenant_limits`` is ignored."""

    tenant_limits: str = ""
    """The same TOML inline, for small deployments (read at start only)."""

    redis_memory_high_water: float = Field(0.85, ge=0, le=1)
    """Fraction of Redis's ``maxmemory`` above which new work that would add to Redis
    (inference requests, jobs, batch jobs) is refused with 503 + Retry-After, so that
    Redis never fills up with what was already accepted. No check when Redis has no
    ``maxmemory``, or with 0."""

    max_job_wait_s: float = Field(60.0, ge=0)
    """The longest ``Prefer: wait=N`` a result request may hold (long-polling)."""

    strict_readiness: bool = True
    """As Triton's --strict-readiness (its default): /v2/health/ready is true only while
    every model version in the repository is ready. False: ready once the gateway can
    reach Redis and knows the catalog, whatever the models' state."""

    ssl_certfile: str = ""
    """PEM certificate: serve HTTPS when set (with ``ssl_keyfile``)."""

    ssl_keyfile: str = ""
    """PEM private key of ``ssl_certfile``."""

    grpc_use_ssl: bool = False
    """Triton's --grpc-use-ssl: gRPC over TLS with ``grpc_server_cert`` and
    ``grpc_server_key`` (else the HTTP certificate, ``ssl_certfile``). gRPC is also over TLS
    whenever HTTP is."""

    grpc_use_ssl_mutual: bool = False
    """Triton's --grpc-use-ssl-mutual: gRPC over TLS, and only clients whose certificate
    ``grpc_root_cert`` signed may connect."""

    grpc_server_cert: str = ""
    """Triton's --grpc-server-cert: PEM certificate of the gRPC port."""

    grpc_server_key: str = ""
    """Triton's --grpc-server-key: PEM private key of ``grpc_server_cert``."""

    grpc_root_cert: str = ""
    """Triton's --grpc-root-cert: PEM certificates of the authorities that sign clients'
    certificates (``grpc_use_ssl_mutual``)."""

    @model_validator(mode="after")
    def _grpc_tls_complete(self) -> GatewaySettings:
        tls = self.grpc_use_ssl or self.grpc_use_ssl_mutual
        if tls and not (self.grpc_server_cert or self.ssl_certfile):
            raise ValueError(
                "gRPC over TLS (SLUICE_GRPC_USE_SSL) needs SLUICE_GRPC_SERVER_CERT and "
                "SLUICE_GRPC_SERVER_KEY, or the HTTP certificate (SLUICE_SSL_CERTFILE)"
            )
        if self.grpc_server_key and not self.grpc_server_cert:
            # (It would be dropped for the HTTP certificate's key without a word.)
            raise ValueError(
                "SLUICE_GRPC_SERVER_KEY is the key of SLUICE_GRPC_SERVER_CERT, which is not set"
            )
        if self.grpc_use_ssl_mutual and not self.grpc_root_cert:
            raise ValueError(
                "SLUICE_GRPC_USE_SSL_MUTUAL needs SLUICE_GRPC_ROOT_CERT: the authorities "
                "whose client certificates are accepted"
            )
        return self

    shutdown_timeout_s: float = Field(10.0, gt=0)
    """How long a stopping gateway waits for in-flight requests."""

    shm_same_host: bool = False
    """The gateway and every worker share this host's /dev/shm: client shared memory
    regions are read and written by the workers themselves, and large tensors travel
    through shared memory segments instead of Redis. False (several hosts): every byte
    goes through Redis, and the gateway reads and writes client regions itself.
    ``sluice up`` (one machine) turns it on."""

    shm_threshold_bytes: int = Field(1 * MIB, ge=0)
    """With ``shm_same_host``: inputs and outputs larger than this travel through a shared
    memory segment instead of the Redis entry; 0 keeps them all in Redis."""

    shm_sweep_interval_s: float = Field(10.0, gt=0)
    """How often the gateway removes shared memory segments their creators left behind."""

    allow_client_shm: bool | None = None
    """Whether clients may register shared memory regions (Triton's --allow-client-shm).
    A region may name any POSIX shm object the gateway's user can open, which the workers
    then read and write, so by default (None) only a gateway bound to loopback or guarded
    by admin keys allows it."""

    max_shm_regions: int = Field(1024, ge=0, le=1_000_000)
    """Client shared memory regions (system and CUDA together) registered at once on one
    host, through any of its gateway processes; one more is refused with 429."""

    tenant_max_shm_regions: int = Field(256, ge=0, le=1_000_000)
    """With API keys: client shared memory regions one tenant registers at once on one
    host (system and CUDA together); one more is refused with 429, so that no tenant takes
    the whole of ``max_shm_regions`` from the others, which still bounds the host. Without
    API keys the one tenant has the host's ``max_shm_regions``."""


class RateLimitSettings(BaseSettings):
    """Triton's rate limiter (:mod:`sluice.core.rate_limit`): read by the workers; ``sluice
    up`` checks the values at start and its workers inherit them."""

    model_config = SettingsConfigDict(env_prefix="SLUICE_", extra="ignore")

    rate_limit: Literal["off", "execution_count"] = "off"
    """Triton's --rate-limit: ``execution_count`` makes each instance whose group lists
    ``rate_limiter`` resources hold them while it computes a batch, and wait for them
    while other instances hold too many; ``off``: instances compute as soon as they can."""

    rate_limit_resources: str = ""
    """Triton's --rate-limit-resource, comma separated: ``<name>:<count>`` (every device, and
    a global resource) or ``<name>:<count>:<device>``; a resource not named has as many
    copies as the most any instance using it needs."""

    @field_validator("rate_limit", mode="before")
    @classmethod
    def _mode_any_case(cls, value: object) -> object:
        return value.strip().lower() if isinstance(value, str) else value

    @field_validator("rate_limit_resources")
    @classmethod
    def _resources_parse(cls, value: str) -> str:
        parse_resource_counts(value)
        return value


class WorkerSettings(RateLimitSettings, ResponseCacheSettings, CommonSettings):
    """Settings of a worker process, one instance of one model version."""

    threads: int = Field(0, ge=0)
    """Compute threads per worker; 0: the cores divided among the instances of its own model
    (what `sluice up` passes), or every core for a worker started alone."""

    heartbeat_s: float = Field(1.0, gt=0)
    """How often a worker announces itself; it counts as dead after three missed beats."""

    reply_max_len: int = Field(100_000, ge=100)
    """Approximate cap on each gateway's reply stream (XADD MAXLEN ~)."""

    visibility_timeout_s: float = Field(60.0, gt=0)
    """A request held this long by a worker that still beats is delivered again elsewhere."""

    max_deliveries: int = Field(3, ge=1)
    """Deliveries after which a request goes to the dead-letter stream with an error answer."""

    reclaim_interval_s: float = Field(1.0, gt=0)
    """How often a worker looks for requests held by dead workers."""

    load_errors_key: str = ""
    """Where a worker that cannot load its model writes why (default: the catalog's load
    errors); ``sluice up`` sets it for a load on request, see
    scheduler/executor/model_control.py."""

    load_retries_left: int = Field(0, ge=0)
    """How many more times ``sluice up`` starts this worker again if it cannot load its
    model (--model-load-retry-count): while some are left, a failure is not published as the
    model's load error (the model stays LOADING)."""

    worker_stop_grace_s: float = Field(
        30.0,
        gt=0,
        le=3600,
        validation_alias=AliasChoices(
            "SLUICE_WORKER_STOP_GRACE_S", "SLUICE_ON_DEMAND_STOP_GRACE_S"
        ),
    )
    """When the process that started this worker dies (``sluice up`` or its fork server,
    even killed with SIGKILL), the worker gets SIGTERM; one still running this long later
    (it ignores SIGTERM, or hangs in its model's code) kills itself (SIGKILL). ``sluice up``
    passes its own value."""


class ControllerSettings(RepositorySourceSettings, CommonSettings):
    """Settings of a controller process; several may run, one leads (see
    :mod:`sluice.scheduler.controller.leadership`)."""

    lease_ttl_s: float = Field(3.0, gt=0)
    """Lifetime of the leader's lease: a standby takes over at most this long after the
    leader's last renewal (after its death)."""

    lease_renew_s: float = Field(1.0, gt=0)
    """How often the leader renews its lease, and the longest a standby waits between two
    attempts to take it; well below ``lease_ttl_s``."""

    controller_id: str = Field(default_factory=lambda: f"{socket.gethostname()}:{os.getpid()}")
    """Who holds the lease, as shown to the others (default: host:pid)."""

    model_repository: RepositoryLocations = ()
    """The repositories the executors serve (local directories or ``s3://bucket/prefix``;
    several as a JSON list): the controller reads them for rollouts and, in poll mode, lists
    them for changes. Empty: no polling, and rollouts only of versions the catalog already
    knows."""

    _locations = field_validator("model_repository", mode="before")(repository_locations)

    executor: Literal["local", "kubernetes"] = "local"
    """Who carries the wanted instance counts out: ``local``, ``sluice up`` (worker
    processes); ``kubernetes``, this controller, by scaling the worker Deployments and
    publishing the catalog (:mod:`sluice.scheduler.executor.kubernetes`, the ``kubernetes``
    extra)."""

    kubernetes_namespace: str = ""
    """Namespace of the worker Deployments; empty: the controller pod's own."""

    kubernetes_selector: str = "app.kubernetes.io/component=worker,sluice.dev/scaler=controller"
    """Label selector of the worker Deployments the controller scales."""

    kubernetes_rollout_selector: str = "app.kubernetes.io/component=worker"
    """Label selector of the worker Deployments whose rollouts the controller follows, however
    they are scaled: once one has replaced all its pods (new weights, say), the catalog's
    revision moves and the response cache starts afresh. Empty: none followed."""

    kubernetes_context: str = ""
    """Outside a cluster: the kubeconfig context to use (empty: the current one)."""


class BatchSettings(BatchStoreSettings, CommonSettings):
    """Settings of a batch worker (``sluice batch-worker``, or started by ``sluice up``)."""

    batch_concurrency: int = Field(1, ge=1, le=64)
    """Shard tasks one batch worker runs at once (threads)."""

    batch_shard_lease_s: float = Field(15.0, ge=2)
    """A running shard renews its lease every second; a shard whose worker died (no
    renewal for this long) is given to another worker."""

    batch_visibility_timeout_s: float = Field(3600.0, gt=0)
    """The broker's last resort: a shard task message not acknowledged for this long is
    delivered again (a redelivery while its shard is leased does nothing); a shard sent
    this long ago that no attempt ever took (its message lost) is sent again."""

    batch_shards_in_flight: int = Field(16, ge=1, le=100_000)
    """Shard tasks one running batch job keeps queued or running at once (its window): the
    next is sent as one ends, so that a job of many shards takes little room in Redis and
    the jobs of every tenant take turns in the batch queue. 16 keeps busy as many batch
    workers as ``sluice up`` starts at most (``SLUICE_BATCH_WORKERS``, with the default
    ``SLUICE_BATCH_CONCURRENCY``); raise it where more batch worker threads should work on
    one job at once."""

    batch_task_time_limit_s: float = Field(3600.0, gt=0)
    """A shard task running longer is stopped (and retried)."""

    batch_max_line_bytes: int = Field(64 * MIB, ge=1)
    """Longest line of a JSON Lines input (one v2 request, as large as one online request
    may be); a longer line fails its row (its answer is the error, naming the line), and is
    never held whole."""

    batch_max_shard_bytes: int = Field(256 * MIB, ge=1)
    """Most bytes one shard's rows may take in a batch worker's memory, inputs and outputs
    (those of fixed size) together: a job is split into shards of fewer rows than its
    ``options.shard_rows`` where they would take more (large rows, or a client asking for
    huge shards)."""

    batch_max_expanded_bytes: int = Field(8 * GIB, ge=1)
    """Most bytes one compressed ``.npz`` array may expand to (it is expanded once into a
    scratch file, then read a shard at a time), and one Parquet row group's column may
    decode to; beyond it the job fails, naming the array or column and this setting."""


def _default_redis_maxmemory() -> int:
    """A quarter of the machine's memory, at most 2 GiB (2 GiB where it cannot be read)."""
    try:
        physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 2 * GIB
    return max(64 * MIB, min(physical // 4, 2 * GIB))


def _default_memory_budget() -> int:
    """Three quarters of the machine's memory (4 GiB where it cannot be read)."""
    try:
        physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 4 * GIB
    return max(MIB, physical * 3 // 4)


class UpSettings(RepositorySourceSettings, RateLimitSettings, CommonSettings):
    """Settings of ``sluice up``; the gateway and worker settings pass through the environment."""

    model_repository: RepositoryLocations = ("model_repository",)
    """Triton-layout model repositories: a local directory, or ``s3://bucket/prefix``
    (copied into ``repository_cache_dir`` at start); several as a JSON list (the command
    line's ``--model-repository`` given more than once), served together as Triton serves
    them: model names are unique across them, and a name found in two or more is
    unavailable (unless ``model_namespacing``)."""

    @field_validator("model_repository", mode="before")
    @classmethod
    def _some_locations(cls, value: object) -> object:
        value = repository_locations(value)
        if value == ():
            raise ValueError("name at least one model repository")
        return value

    http_host: str = "127.0.0.1"
    """Address the gateways' HTTP server binds to (passed to them as SLUICE_HTTP_HOST)."""

    http_port: int = Field(8000, ge=0, le=65535)
    """Port of the gateways' HTTP API (passed to them as SLUICE_HTTP_PORT)."""

    gateway_processes: int = Field(default_factory=auto_gateway_processes, ge=1, le=64)
    """Gateway processes sharing the HTTP and gRPC ports (each has its own reply stream):
    ``auto`` (the default) starts one per two CPUs this process may run on (its affinity),
    at least 1 and at most 16; or a number from 1 to 64."""

    _gateway_processes_auto = field_validator("gateway_processes", mode="before")(
        gateway_processes_value
    )

    metrics_port: int = Field(8002, ge=0, le=65535)
    """The metrics-only port, Triton's 8002 (0: none; ``/metrics`` is on the HTTP port too)."""

    grpc_port: int = Field(8001, ge=0, le=65535)
    """The gRPC port, Triton's 8001, shared by the gateway processes (0: no gRPC)."""

    gateway: bool = True
    """False: publish the catalog and run the workers only (gateways run elsewhere)."""

    batch_workers: int = Field(1, ge=0, le=16)
    """Batch workers (Celery, for ``POST /v2/batches``) to start; 0: none. They need the
    ``batch`` extra."""

    batch_store: str = Field(default_factory=_default_batch_store)
    """Passed to the gateways and batch workers (SLUICE_BATCH_STORE): where uploads and
    batch outputs are kept, a data directory of its own by default, never the directory
    ``sluice up`` was started in."""

    controller: bool = True
    """Run the controller (autoscaling, rollouts, poll mode's decisions) in this process as
    well, contending for the lease; false: an executor only, decided for by a controller
    elsewhere (``sluice controller``)."""

    model_control_mode: Literal["none", "explicit", "poll", "demand"] = "none"
    """Triton's --model-control-mode: ``none`` serves every model of the repository and
    refuses load / unload; ``explicit`` loads the ``load_model`` ones at start and the rest
    on request (``POST /v2/repository/models/{m}/load`` and ``/unload``); ``poll`` serves
    every model and loads again what changes in the repository (every
    ``repository_poll_s``), refusing load / unload requests. Sluice's own ``demand`` lists
    every model and loads each when a request for it comes, unloading the least recently
    used ones when ``memory_budget`` would be exceeded (models with the parameter
    ``sluice.pinned`` ``true`` are loaded at start and stay); load / unload requests are
    refused. In ``none`` mode, models with the parameter ``sluice.load`` ``on_demand`` are
    loaded that way."""

    memory_budget: int = Field(default_factory=_default_memory_budget, ge=MIB)
    """The memory this host's on-demand models may hold together: a size such as ``16GiB``
    or ``512MB``. Measured (the memory only each worker holds), not declared. Pinned
    models and the other models of ``none`` mode are outside it: give the on-demand models
    what those leave. Default: three quarters of the machine's memory."""

    gpu_memory_budget: Annotated[dict[int, int], NoDecode] = Field(default_factory=dict)
    """Per GPU, the memory this host's on-demand models may hold on it together
    (``0:70GiB,1:70GiB``, each at least 1 MiB), measured through NVML; a GPU not named has
    no budget. Needs NVML."""

    min_residency_s: float = Field(10.0, ge=0, le=86400)
    """An on-demand model loaded less than this long ago is not evicted for another: with
    more traffic than memory, models are not loaded and evicted in a loop."""

    fork_server: bool = True
    """With on-demand models: fork their workers from one process that has done a worker's
    imports (a cold start then skips the second of CPU they take, and the workers share
    those pages); false: start each as its own process."""

    on_demand_load_timeout_s: float = Field(120.0, gt=0, le=86400)
    """How long an on-demand model's workers have, from their start, to be ready (their
    model loaded, their first heartbeat). Past it the load is abandoned: its workers are
    killed, its memory given back, and the model is unavailable with the reason, its waiting
    requests answered 503 (until the executor restarts, as another failed load)."""

    worker_stop_grace_s: float = Field(
        30.0,
        gt=0,
        le=3600,
        validation_alias=AliasChoices(
            "SLUICE_WORKER_STOP_GRACE_S", "SLUICE_ON_DEMAND_STOP_GRACE_S"
        ),
    )
    """How long a worker asked to stop (its model unloaded, replaced or scaled down, an
    on-demand model unloaded to make room, ``sluice up`` stopping) has to answer what it
    holds and exit before it is killed (SIGKILL); Triton's ``--exit-timeout-secs`` sets it
    too. A load abandoned at its deadline gets none: its workers are killed at once. With
    on-demand models, what a leaving worker holds counts against the memory budget until it
    has exited."""

    shutdown_timeout_s: float = Field(10.0, gt=0)
    """How long a stopping gateway waits for in-flight requests (the gateways read it too;
    Triton's ``--exit-timeout-secs`` sets it): when ``sluice up`` stops, a gateway still
    running 5 s after that is killed (SIGKILL)."""

    @field_validator("memory_budget", mode="before")
    @classmethod
    def _memory_budget_size(cls, value: object) -> object:
        return parse_size(value, "SLUICE_MEMORY_BUDGET") if isinstance(value, str) else value

    @field_validator("gpu_memory_budget", mode="before")
    @classmethod
    def _gpu_budget_sizes(cls, value: object) -> object:
        if isinstance(value, str):
            return parse_gpu_budgets(value, "SLUICE_GPU_MEMORY_BUDGET")
        return value

    load_model: list[str] = Field(default_factory=list)
    """With ``explicit``: the models to load at start (Triton's --load-model; ``*``: all)."""

    snapshot_dir: Path | None = None
    """With ``explicit``: a folder where ``sluice up`` keeps a snapshot of the models it has
    loaded and how (TorchServe's snapshots), written after every load and unload; a start
    while no other executor is alive loads them again. None: no snapshot (Triton starts
    afresh)."""

    model_control_timeout_s: float = Field(120.0, gt=0)
    """How long a load may take (workers started and ready) before it counts as failed."""

    http_restricted_api: str = Field("", repr=False)
    """Passed to the gateways as it is (SLUICE_HTTP_RESTRICTED_API, Triton's
    --http-restricted-api); ``sluice up``'s readiness probe sends the repository index's
    header."""

    _restrictions = field_validator("http_restricted_api")(_restrictions_value)

    model_load_retry_count: int = Field(0, ge=0, le=100)
    """Triton's --model-load-retry-count: how many more times a worker that failed to load
    its model (an exception from the model's loading, a crash while loading) is started
    again at once before the model counts as failed to load; 0: never. Applies to the
    loads at start, on request, on demand and to added instances; an explicit load's
    retries all fall within ``model_control_timeout_s``."""

    ssl_certfile: str = ""
    """Passed to the gateway (SLUICE_SSL_CERTFILE): ``sluice up`` then serves and probes HTTPS."""

    torchserve_ports: str = ""
    """TorchServe's inference, management and metrics ports, served by the gateways beside
    Sluice's own (as SLUICE_TORCHSERVE_PORTS: ``8080,8081,8082`` with ``sluice up
    --torchserve``, or the addresses of TorchServe's ``config.properties`` with
    ``--ts-config``)."""

    _torchserve_ports_valid = field_validator("torchserve_ports")(torchserve_ports_value)

    start_redis: bool = True
    """Start a private redis-server when SLUICE_REDIS_URL is not set."""

    redis_maxmemory: int = Field(default_factory=_default_redis_maxmemory, ge=MIB)
    """``maxmemory`` of the private redis-server, in bytes (``maxmemory-policy noeviction``:
    once full, Redis refuses writes and requests are answered 503 instead of queued data
    being dropped). Default: a quarter of the machine's memory, at most 2 GiB."""

    ready_timeout_s: float = Field(120.0, gt=0)
    """How long ``sluice up`` waits for every model to become ready."""

    exit_on_error: bool = False
    """As Triton's --exit-on-error: true makes ``sluice up`` exit with status 1, naming the
    models, when a model fails to load at start (checked while it waits for readiness, so
    not with ``--no-gateway``). False by default, unlike Triton: on a server shared by
    tenants, one tenant's broken model should not stop everyone's; it is served as
    UNAVAILABLE, with the reason."""

    shm_same_host: bool = True
    """Passed to the gateway: everything ``sluice up`` starts shares one host."""
