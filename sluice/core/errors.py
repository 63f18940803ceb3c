"""The error hierarchy shared by every process.

Each error carries one HTTP status (as :class:`http.HTTPStatus`, so the core
never imports a web framework), one gRPC status code (by its name in ``grpc.StatusCode``,
so the core never imports grpc; as Triton maps its error codes) and one message that is
sent to clients as ``{"error": message}`` or as the gRPC status details. Per-request
errors are kept apart from fatal ones: everything here concerns a single request or model,
never the process, but for :class:`StartupFailed`, which is no :class:`SluiceError`.
"""

from __future__ import annotations

from http import HTTPStatus

QUEUE_UNREACHABLE = "the request queue (Redis) is unreachable; retry later"
"""What a client is told when Redis cannot be reached: one text wherever it happens, and
never the Redis client's own error, which names the server's internal address."""


class SluiceError(Exception):
    """Root of every error a client can see."""

    status: HTTPStatus = HTTPStatus.INTERNAL_SERVER_ERROR
    grpc_code: str = "INTERNAL"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidInput(SluiceError):
    """The request does not fit the protocol or the model's metadata."""

    status = HTTPStatus.BAD_REQUEST
    grpc_code = "INVALID_ARGUMENT"


class InvalidConfig(SluiceError):
    """A model configuration or repository entry is unusable."""

    status = HTTPStatus.BAD_REQUEST
    grpc_code = "INVALID_ARGUMENT"


class NotFound(SluiceError):
    """Unknown model, version or resource."""

    status = HTTPStatus.NOT_FOUND
    grpc_code = "NOT_FOUND"


class PayloadTooLarge(SluiceError):
    """The request body (or a decompressed body) exceeds the configured limit."""

    status = HTTPStatus.REQUEST_ENTITY_TOO_LARGE
    grpc_code = "RESOURCE_EXHAUSTED"


class Unavailable(SluiceError):
    """The model or a service it depends on (Redis, workers) cannot serve now."""

    status = HTTPStatus.SERVICE_UNAVAILABLE
    grpc_code = "UNAVAILABLE"


class Overloaded(SluiceError):
    """Admission control refused the request; the client should retry later.

    503, as Triton answers a full queue (UNAVAILABLE), not 429: clients and tools that
    retry on Triton's code keep working."""

    status = HTTPStatus.SERVICE_UNAVAILABLE
    grpc_code = "UNAVAILABLE"

    def __init__(self, message: str, retry_after_s: int | None = 1) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
        """Seconds the client should wait before it retries (``Retry-After``); None when
        retrying cannot help, and no ``Retry-After`` is sent: the refusal is final (the
        error a finished job keeps, which every later read answers alike)."""


class ServerBusy(Overloaded):
    """The gateway holds as many requests as it may; retry later."""


class QuotaExceeded(Overloaded):
    """A tenant is over one of its own limits (queued jobs, queued bytes, stored bytes):
    429 with ``Retry-After``, the limit named in the message; other tenants go on."""

    status = HTTPStatus.TOO_MANY_REQUESTS
    grpc_code = "RESOURCE_EXHAUSTED"


class Conflict(SluiceError):
    """The request contradicts what exists: an idempotency key reused with another body."""

    status = HTTPStatus.CONFLICT
    grpc_code = "ALREADY_EXISTS"


class Unauthorized(SluiceError):
    """No valid API key was presented."""

    status = HTTPStatus.UNAUTHORIZED
    grpc_code = "UNAUTHENTICATED"


class Forbidden(SluiceError):
    """The key is valid but does not allow this endpoint."""

    status = HTTPStatus.FORBIDDEN
    grpc_code = "PERMISSION_DENIED"


class DeadlineExceeded(SluiceError):
    """The request's deadline passed before it could be answered."""

    status = HTTPStatus.GATEWAY_TIMEOUT
    grpc_code = "DEADLINE_EXCEEDED"


class Unsupported(SluiceError):
    """A feature the request or configuration asks for is not implemented."""

    status = HTTPStatus.NOT_IMPLEMENTED
    grpc_code = "UNIMPLEMENTED"


class Cancelled(SluiceError):
    """The request's caller went away (a disconnected client, a cancelled gRPC call, a
    cancelled job) before it was computed. Its status is Triton's ``CANCELLED``; no HTTP
    client sees it, as none is left to answer."""

    grpc_code = "CANCELLED"


class InferenceFailed(SluiceError):
    """The backend raised while computing a batch."""

    status = HTTPStatus.INTERNAL_SERVER_ERROR


class HandlerFailed(InferenceFailed):
    """A model's own code failed a request with a status of its choosing: a TorchServe
    handler's ``PredictionException`` code, or TorchServe's 503 (``Prediction failed``) and
    507 (``Out of resources``) for a handler that raised. The status is the instance's (a
    client error, 400 to 499, or a server error, 500 to 599; any other is 500), and travels
    between processes in the error's kind (``HandlerFailed:422``)."""

    def __init__(self, message: str, status: int = HTTPStatus.SERVICE_UNAVAILABLE) -> None:
        super().__init__(message)
        self.status = _error_status(status)
        self.grpc_code = _GRPC_CODES.get(self.status, "INTERNAL")


_GRPC_CODES = {
    HTTPStatus.BAD_REQUEST: "INVALID_ARGUMENT",
    HTTPStatus.NOT_FOUND: "NOT_FOUND",
    HTTPStatus.TOO_MANY_REQUESTS: "RESOURCE_EXHAUSTED",
    HTTPStatus.SERVICE_UNAVAILABLE: "UNAVAILABLE",
    HTTPStatus.INSUFFICIENT_STORAGE: "RESOURCE_EXHAUSTED",
}
"""The gRPC code of a :class:`HandlerFailed` status, as the fixed classes map theirs."""


def _error_status(code: int) -> HTTPStatus:
    try:
        status = HTTPStatus(code)
    except ValueError:
        return HTTPStatus.INTERNAL_SERVER_ERROR
    return status if 400 <= status < 600 else HTTPStatus.INTERNAL_SERVER_ERROR


_BY_NAME: dict[str, type[SluiceError]] = {
    cls.__name__: cls
    for cls in (
        SluiceError,
        InvalidInput,
        InvalidConfig,
        NotFound,
        PayloadTooLarge,
        Unavailable,
        Overloaded,
        ServerBusy,
        QuotaExceeded,
        Cancelled,
        Conflict,
        Unauthorized,
        Forbidden,
        DeadlineExceeded,
        Unsupported,
        InferenceFailed,
    )
}


def error_kind(error: SluiceError) -> str:
    """The name under which an error travels between processes (with its status, for an
    error whose status is its own: :class:`HandlerFailed`)."""
    if isinstance(error, HandlerFailed):
        return f"{HandlerFailed.__name__}:{int(error.status)}"
    return type(error).__name__


def error_from_kind(kind: str, message: str) -> SluiceError:
    """Rebuild an error received from another process; unknown kinds become the root."""
    known = _BY_NAME.get(kind)
    if known is not None:
        return known(message)
    name, _, code = kind.partition(":")
    if name == HandlerFailed.__name__ and code.isdigit() and len(code) == 3:
        return HandlerFailed(message, int(code))
    return SluiceError(message)


class StartupFailed(Exception):
    """A process cannot start (an unreadable repository, a port in use, no redis-server): the
    one fatal error, kept apart from :class:`SluiceError` because no client ever sees it. The
    command line prints ``error: <message>`` on stderr and exits with ``exit_status``."""

    def __init__(self, message: str, exit_status: int = 2) -> None:
        super().__init__(message)
        self.message = message
        self.exit_status = exit_status
