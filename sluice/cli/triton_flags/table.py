"""The table of every flag of ``tritonserver`` and what Sluice does with it."""

from __future__ import annotations

from sluice.cli.triton_flags import handlers
from sluice.cli.triton_flags.values import TritonFlag
from sluice.core.dispatch import STREAM_BACKLOG

_IGNORED_TUNING = "tuning of Triton's own threads and memory, which Sluice does not have"

FLAGS_LIST: tuple[TritonFlag, ...] = (
    # Server
    TritonFlag("id", "text", "ignored", "Sluice names itself sluice in server metadata."),
    TritonFlag(
        "exit-timeout-secs",
        "int",
        "mapped",
        "SLUICE_SHUTDOWN_TIMEOUT_S: how long a stopping gateway waits for in-flight "
        "requests (at least 1 s), and SLUICE_WORKER_STOP_GRACE_S: how long a worker asked "
        "to stop has to answer what it holds before it is killed.",
        handlers.exit_timeout,
    ),
    # Logging
    TritonFlag(
        "log-verbose",
        "int",
        "mapped",
        "SLUICE_LOG_VERBOSE_LEVEL (true is 1, false is 0): 1 or more logs debug messages too.",
        handlers.log_verbose,
    ),
    TritonFlag(
        "log-info", "bool", "mapped", "SLUICE_LOG_INFO.", handlers.env_bool("SLUICE_LOG_INFO")
    ),
    TritonFlag(
        "log-warning",
        "bool",
        "mapped",
        "SLUICE_LOG_WARNING.",
        handlers.env_bool("SLUICE_LOG_WARNING"),
    ),
    TritonFlag(
        "log-error", "bool", "mapped", "SLUICE_LOG_ERROR.", handlers.env_bool("SLUICE_LOG_ERROR")
    ),
    TritonFlag(
        "log-format",
        "text",
        "mapped",
        "SLUICE_LOG_FORMAT: default is text, ISO8601 is iso8601.",
        handlers.log_format,
    ),
    TritonFlag(
        "log-file",
        "text",
        "mapped",
        "SLUICE_LOG_FILE: every process appends its lines to the file.",
        handlers.env_text("SLUICE_LOG_FILE"),
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
        handlers.exit_on_error,
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
        handlers.env_bool("SLUICE_STRICT_READINESS"),
    ),
    TritonFlag("model-control-mode", "text", "option", "Sluice's option (any case)."),
    TritonFlag(
        "repository-poll-secs",
        "int",
        "mapped",
        "SLUICE_REPOSITORY_POLL_S: seconds between listings of the repository, 1 or more.",
        handlers.poll_secs,
    ),
    TritonFlag("load-model", "text", "option", "Sluice's option, repeatable."),
    TritonFlag(
        "model-config-name",
        "text",
        "mapped",
        "SLUICE_MODEL_CONFIG_NAME: a model with configs/<name>.pbtxt is served with it "
        "instead of its config.pbtxt.",
        handlers.model_config_name,
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
        handlers.load_retries,
    ),
    TritonFlag(
        "model-namespacing",
        "bool",
        "mapped",
        "SLUICE_MODEL_NAMESPACING: each repository is a namespace; a name several hold is "
        "served from each (an ensemble calls its own repository's), and a request naming it "
        "alone is refused as ambiguous, as in Triton.",
        handlers.env_bool("SLUICE_MODEL_NAMESPACING"),
    ),
    # HTTP
    TritonFlag(
        "allow-http",
        "bool",
        "refused",
        "Sluice always serves HTTP (its readiness and control go through it); leave the flag "
        "out, or bind --http-address 127.0.0.1 to keep it local.",
        fine=handlers.means(True),
    ),
    TritonFlag("http-address", "text", "option", "Sluice's option, as --http-host."),
    TritonFlag("http-port", "int", "option", "Sluice's option."),
    TritonFlag(
        "reuse-http-port",
        "bool",
        "ignored",
        "sluice up's own gateway processes share the HTTP port; another server cannot.",
        fine=handlers.means(False),
    ),
    TritonFlag(
        "http-header-forward-pattern",
        "text",
        "mapped",
        "SLUICE_HTTP_HEADER_FORWARD_PATTERN: headers whose names match become string "
        "parameters of each inference request (ignoring case unless the pattern starts with "
        "(?-i)); Authorization never does.",
        handlers.header_pattern("SLUICE_HTTP_HEADER_FORWARD_PATTERN"),
    ),
    TritonFlag("http-thread-count", "int", "ignored", _IGNORED_TUNING + "."),
    TritonFlag(
        "http-restricted-api",
        "text",
        "mapped",
        "SLUICE_HTTP_RESTRICTED_API (repeatable; groups joined by ';'): the endpoints of "
        "the categories named answer 403 without the header; beside Sluice's API keys.",
        handlers.restricted("SLUICE_HTTP_RESTRICTED_API"),
    ),
    # GRPC
    TritonFlag(
        "allow-grpc",
        "bool",
        "mapped",
        "false: no gRPC port (grpc_port 0), whatever --grpc-port says.",
        handlers.allow_grpc,
    ),
    TritonFlag(
        "grpc-address",
        "text",
        "mapped",
        "accepted when it is the HTTP address (--http-address), which Sluice serves gRPC on; "
        "another address is refused.",
        handlers.address,
    ),
    TritonFlag("grpc-port", "int", "option", "Sluice's option."),
    TritonFlag(
        "reuse-grpc-port",
        "bool",
        "ignored",
        "sluice up's own gateway processes share the gRPC port; another server cannot.",
        fine=handlers.means(False),
    ),
    TritonFlag(
        "grpc-header-forward-pattern",
        "text",
        "mapped",
        "SLUICE_GRPC_HEADER_FORWARD_PATTERN: metadata whose names match become string "
        "parameters of each inference request, as --http-header-forward-pattern.",
        handlers.header_pattern("SLUICE_GRPC_HEADER_FORWARD_PATTERN"),
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
        handlers.env_bool("SLUICE_GRPC_USE_SSL"),
    ),
    TritonFlag(
        "grpc-use-ssl-mutual",
        "bool",
        "mapped",
        "SLUICE_GRPC_USE_SSL_MUTUAL: gRPC over TLS, accepting only clients whose "
        "certificate --grpc-root-cert signed.",
        handlers.env_bool("SLUICE_GRPC_USE_SSL_MUTUAL"),
    ),
    TritonFlag(
        "grpc-server-cert",
        "text",
        "mapped",
        "SLUICE_GRPC_SERVER_CERT: the gRPC port's certificate (with --grpc-use-ssl).",
        handlers.env_text("SLUICE_GRPC_SERVER_CERT"),
    ),
    TritonFlag(
        "grpc-server-key",
        "text",
        "mapped",
        "SLUICE_GRPC_SERVER_KEY: the private key of --grpc-server-cert.",
        handlers.env_text("SLUICE_GRPC_SERVER_KEY"),
    ),
    TritonFlag(
        "grpc-root-cert",
        "text",
        "mapped",
        "SLUICE_GRPC_ROOT_CERT: the authorities whose client certificates "
        "--grpc-use-ssl-mutual accepts.",
        handlers.env_text("SLUICE_GRPC_ROOT_CERT"),
    ),
    TritonFlag(
        "grpc-infer-response-compression-level",
        "text",
        "mapped",
        "SLUICE_GRPC_RESPONSE_COMPRESSION: none is none; low, medium and high are gzip.",
        handlers.compression,
    ),
    TritonFlag(
        "grpc-keepalive-time",
        "int",
        "mapped",
        "SLUICE_GRPC_KEEPALIVE_TIME_S (Triton's milliseconds as seconds).",
        handlers.env_seconds_from_ms("SLUICE_GRPC_KEEPALIVE_TIME_S"),
    ),
    TritonFlag(
        "grpc-keepalive-timeout",
        "int",
        "mapped",
        "SLUICE_GRPC_KEEPALIVE_TIMEOUT_S (Triton's milliseconds as seconds).",
        handlers.env_seconds_from_ms("SLUICE_GRPC_KEEPALIVE_TIMEOUT_S"),
    ),
    TritonFlag(
        "grpc-keepalive-permit-without-calls",
        "bool",
        "mapped",
        "SLUICE_GRPC_KEEPALIVE_PERMIT_WITHOUT_CALLS: clients may ping connections without "
        "calls (idle connections still close after SLUICE_GRPC_MAX_CONNECTION_IDLE_S).",
        handlers.env_bool("SLUICE_GRPC_KEEPALIVE_PERMIT_WITHOUT_CALLS"),
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
        handlers.env_count("SLUICE_GRPC_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS"),
    ),
    TritonFlag(
        "grpc-http2-max-ping-strikes",
        "int",
        "mapped",
        "SLUICE_GRPC_HTTP2_MAX_PING_STRIKES: a client past this many strikes is sent away "
        "(0: never).",
        handlers.env_count("SLUICE_GRPC_HTTP2_MAX_PING_STRIKES"),
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
        handlers.restricted("SLUICE_GRPC_RESTRICTED_PROTOCOL"),
    ),
    # SageMaker and Vertex AI
    TritonFlag(
        "allow-sagemaker",
        "bool",
        "refused",
        "Sluice has no SageMaker endpoint; serve SageMaker from Triton.",
        fine=handlers.means(False),
    ),
    TritonFlag("sagemaker-port", "int", "ignored", "Sluice has no SageMaker endpoint."),
    TritonFlag("sagemaker-safe-port-range", "text", "ignored", "Sluice has no SageMaker endpoint."),
    TritonFlag("sagemaker-thread-count", "int", "ignored", "Sluice has no SageMaker endpoint."),
    TritonFlag(
        "allow-vertex-ai",
        "bool",
        "refused",
        "Sluice has no Vertex AI endpoint; serve Vertex AI from Triton.",
        fine=handlers.means(False),
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
        handlers.env_bool("SLUICE_ALLOW_CLIENT_SHM"),
    ),
    TritonFlag(
        "allow-metrics",
        "bool",
        "mapped",
        "SLUICE_ALLOW_METRICS; false also closes the metrics port (metrics_port 0), "
        "whatever --metrics-port says, and GET /metrics answers 404.",
        handlers.allow_metrics,
    ),
    TritonFlag(
        "allow-gpu-metrics",
        "bool",
        "ignored",
        "Sluice's GPU metrics follow --allow-metrics alone.",
        fine=handlers.means(True),
    ),
    TritonFlag(
        "allow-cpu-metrics",
        "bool",
        "ignored",
        "Sluice's host metrics follow --allow-metrics alone.",
        fine=handlers.means(True),
    ),
    TritonFlag(
        "metrics-address",
        "text",
        "mapped",
        "accepted when it is the HTTP address (--http-address), which Sluice serves metrics "
        "on; another address is refused.",
        handlers.address,
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
        handlers.metrics_config,
    ),
    # Tracing
    TritonFlag(
        "trace-config",
        "text",
        "mapped",
        "opentelemetry,url=URL is SLUICE_OTLP_ENDPOINT (without /v1/traces) and "
        "opentelemetry,resource=service.name=NAME is OTEL_SERVICE_NAME; Sluice then traces "
        "every request. Other settings are ignored, one warning each.",
        handlers.trace_config,
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
        handlers.backend_config,
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
        handlers.cache_config,
    ),
    TritonFlag("cache-directory", "text", "ignored", "Sluice's response cache lives in Redis."),
    TritonFlag(
        "response-cache-byte-size",
        "int",
        "mapped",
        "SLUICE_RESPONSE_CACHE_BYTES (Triton's older spelling of --cache-config local,size).",
        handlers.cache_bytes,
    ),
    # Rate limiter
    TritonFlag(
        "rate-limit",
        "text",
        "mapped",
        "SLUICE_RATE_LIMIT (off or execution_count): instances whose group lists "
        "rate_limiter resources hold them while they compute.",
        handlers.rate_limit,
    ),
    TritonFlag(
        "rate-limit-resource",
        "text",
        "mapped",
        "SLUICE_RATE_LIMIT_RESOURCES (repeatable; <name>:<count>[:<device>], joined by ','): "
        "the copies of a rate limiter resource.",
        handlers.rate_limit_resource,
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
        fine=handlers.means(False),
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
        fine=handlers.means(False),
    ),
)

FLAGS: dict[str, TritonFlag] = {flag.name: flag for flag in FLAGS_LIST}
