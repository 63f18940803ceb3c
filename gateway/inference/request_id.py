"""The id a request is known by in logs, traces, the stream entry and the ``X-Request-ID``
response header: the client's KServe ``id`` when it sent one, else its ``X-Request-ID``
header, else one made up here. It lives in
:data:`sluice.core.observability.logs.REQUEST_ID`, a context variable, so every log line of
the request's task carries it.

An id is used only when it can travel as a header value unchanged: 1 to 256 printable
ASCII characters, not starting or ending with a space. Anything else (a KServe id with a
newline, say) falls through to the next choice; the response body still echoes the
KServe ``id`` as it came.
"""

from __future__ import annotations

import itertools
import os

from sluice.core.observability.logs import REQUEST_ID

MAX_LENGTH = 256

_PREFIX = os.urandom(6).hex()
_COUNTER = itertools.count(1)


def usable(value: str) -> bool:
    """Whether ``value`` may be a request id (and an ``X-Request-ID`` value) as it is."""
    return (
        0 < len(value) <= MAX_LENGTH
        and value.isascii()
        and value.isprintable()
        and value[0] != " "
        and value[-1] != " "
    )


def new_id() -> str:
    """A fresh id, unique across processes (a random per-process prefix and a counter)."""
    return f"{_PREFIX}-{next(_COUNTER):x}"


def from_header(value: str | None) -> None:
    """Take the client's ``X-Request-ID`` (when usable) as the id so far."""
    if value is not None and usable(value):
        REQUEST_ID.set(value)


def settle(kserve_id: str) -> str:
    """The request's id once its body is parsed: the KServe ``id`` when usable, else the
    header's, else a new one."""
    if kserve_id and usable(kserve_id):
        REQUEST_ID.set(kserve_id)
        return kserve_id
    return current()


def current() -> str:
    """The id so far, made up now if there is none yet (a request refused before its body
    was parsed)."""
    request_id = REQUEST_ID.get()
    if request_id is None:
        request_id = new_id()
        REQUEST_ID.set(request_id)
    return request_id
