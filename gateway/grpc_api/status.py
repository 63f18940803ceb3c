"""gRPC status codes for Sluice's errors (each error class names its own, see
:mod:`sluice.core.errors`), and the messages sent with them: the same texts as over HTTP."""

from __future__ import annotations

import logging

import grpc
from redis.exceptions import RedisError

from sluice.core.errors import QUEUE_UNREACHABLE, SluiceError

log = logging.getLogger(__name__)


def status_of(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The code and details a failed call answers with (an unforeseen error is logged)."""
    code, details = describe(exc)
    if not isinstance(exc, SluiceError | RedisError):
        log.error("gRPC call failed", exc_info=exc)
    return code, details


def describe(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """:func:`status_of` without the log line."""
    if isinstance(exc, SluiceError):
        return grpc.StatusCode[exc.grpc_code], exc.message
    if isinstance(exc, RedisError):
        return grpc.StatusCode.UNAVAILABLE, QUEUE_UNREACHABLE
    return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}"
