"""gRPC status codes for Sluice's errors (each error class names its own, see
:mod:`sluice.core.errors`), and the messages sent with them: the same texts as over HTTP,
cut short when long.

A status's message travels in the ``grpc-message`` trailer, percent-encoded, and gRPC
clients refuse trailers past their metadata limit (8 KiB by default, and outright past
16 KiB): a call whose message echoes a long name, id or shape would reach the client as
RESOURCE_EXHAUSTED "Stream removed" instead of its own error. Messages are cut to
:data:`MAX_DETAILS_BYTES` once encoded, saying how much was left out.
"""

from __future__ import annotations

import logging

import grpc
from redis.exceptions import RedisError

from sluice.core.errors import QUEUE_UNREACHABLE, SluiceError

log = logging.getLogger(__name__)

MAX_DETAILS_BYTES = 4096
"""The most a status's message takes in its trailer, percent-encoded."""
_CUT = "... ({} more characters)"
_CUT_ROOM = len(_CUT) + 20
_WORST_BYTES_PER_CHARACTER = 12
"""Four bytes of UTF-8, each percent-encoded into three."""


def status_of(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The code and details a failed call answers with (an unforeseen error is logged)."""
    code, details = describe(exc)
    if not isinstance(exc, SluiceError | RedisError):
        log.error("gRPC call failed", exc_info=exc)
    return code, bounded(details)


def bounded(details: str) -> str:
    """``details``, cut to :data:`MAX_DETAILS_BYTES` once percent-encoded as gRPC sends it
    (printable ASCII but ``%`` as is, every other byte as ``%XX``)."""
    if len(details) * _WORST_BYTES_PER_CHARACTER <= MAX_DETAILS_BYTES:
        return details
    budget, used, cut = MAX_DETAILS_BYTES - _CUT_ROOM, 0, 0
    for index, character in enumerate(details):
        if " " <= character <= "~" and character != "%":
            used += 1
        else:
            used += 3 * len(character.encode("utf-8", "surrogatepass"))
        if used <= budget:
            cut = index + 1
        elif used > MAX_DETAILS_BYTES:
            return details[:cut] + _CUT.format(len(details) - cut)
    return details


def describe(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """:func:`status_of` without the log line."""
    if isinstance(exc, SluiceError):
        return grpc.StatusCode[exc.grpc_code], exc.message
    if isinstance(exc, RedisError):
        return grpc.StatusCode.UNAVAILABLE, QUEUE_UNREACHABLE
    return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}"
