"""Turning an HTTP answer into the exception the server raised.

The server sends every error as ``{"error": message}`` with the status of one class of
:mod:`sluice.core.errors`; the client raises that class again with the server's message, so code
catches the same exceptions whether it runs next to the server or talks to it over HTTP.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from http import HTTPStatus
from typing import Any

from sluice.core.errors import (
    Conflict,
    DeadlineExceeded,
    Forbidden,
    InferenceFailed,
    InvalidInput,
    NotFound,
    Overloaded,
    PayloadTooLarge,
    QuotaExceeded,
    SluiceError,
    Unauthorized,
    Unavailable,
    Unsupported,
)

_BY_STATUS: dict[int, type[SluiceError]] = {
    400: InvalidInput,
    401: Unauthorized,
    403: Forbidden,
    404: NotFound,
    409: Conflict,
    413: PayloadTooLarge,
    500: InferenceFailed,
    501: Unsupported,
    503: Unavailable,
    504: DeadlineExceeded,
}

_MAX_TEXT = 500
"""Characters of a non-JSON error body kept in the message."""


class MalformedResponse(SluiceError):
    """The server's answer does not follow the protocol (not a server-side error class)."""

    status = HTTPStatus.BAD_GATEWAY


class JobCancelled(SluiceError):
    """The job was cancelled before it finished: it has no result (410)."""

    status = HTTPStatus.GONE


class ServerUnreachable(Unavailable):
    """No HTTP answer came: the connection failed or dropped, every retry included."""


class JobNotFinished(SluiceError):
    """The job's result was asked for before the job finished (202)."""

    status = HTTPStatus.ACCEPTED

    def __init__(self, message: str, job: Mapping[str, Any]) -> None:
        super().__init__(message)
        self.job: dict[str, Any] = dict(job)
        """The job's status as the server showed it (``id``, ``status``, timestamps)."""


class BatchFailed(SluiceError):
    """A batch job ended without completing (failed or cancelled)."""

    def __init__(self, message: str, batch: Mapping[str, Any]) -> None:
        super().__init__(message)
        self.batch: dict[str, Any] = dict(batch)
        """The batch's status as the server showed it last (``error``, ``errors`` ...)."""


def retry_after_s(value: str | None) -> float | None:
    """A ``Retry-After`` header in seconds (None when absent or an HTTP date, unsupported)."""
    if value is None:
        return None
    try:
        seconds = float(value.strip())
    except ValueError:
        return None
    return seconds if seconds >= 0 else None


def error_message(content: bytes, status: int) -> str:
    """The ``error`` of a JSON error body; otherwise the body's text, or the status's
    phrase when the body is empty."""
    try:
        document = json.loads(content)
    except (ValueError, UnicodeDecodeError):
        document = None
    if isinstance(document, dict) and isinstance(document.get("error"), str):
        return str(document["error"])
    text = content.decode(errors="replace").strip()
    if text:
        return text[:_MAX_TEXT]
    try:
        return f"HTTP {status} {HTTPStatus(status).phrase}"
    except ValueError:
        return f"HTTP {status}"


def error_for(status: int, content: bytes, retry_after: str | None = None) -> SluiceError:
    """The exception for an error answer: the class the server raised, its message.

    503 with ``Retry-After`` is :class:`Overloaded` (it carries the delay), 429
    :class:`QuotaExceeded` (a tenant over its own limit, an :class:`Overloaded` too; its
    ``retry_after_s`` None without ``Retry-After``: a refusal that waiting does not lift,
    such as a finished job's); a status of no class of the hierarchy is
    :class:`SluiceError`, its message prefixed with the status."""
    message = error_message(content, status)
    delay = retry_after_s(retry_after)
    if status == 429:
        return QuotaExceeded(message, None if delay is None else max(0, round(delay)))
    if status == 503 and delay is not None:
        return Overloaded(message, retry_after_s=max(0, round(delay)))
    if status == 410:
        return JobCancelled(message)
    cls = _BY_STATUS.get(status)
    if cls is None:
        return SluiceError(message if message.startswith("HTTP ") else f"HTTP {status}: {message}")
    return cls(message)
