"""The HTTP status a TorchServe handler gives one request's answer
(``context.set_response_status(code, phrase, idx)``), from the worker to the gateway.

TorchServe answers each request of a batch with the status its handler set for it, and the
handler's own answer as the body. The worker puts a status other than 200 on the request's
reply as the response parameter :data:`STATUS` (a reply without it, the common case, is
200); TorchServe's routes answer with it. The reason phrase is not carried: the HTTP server
writes the standard one for the code.
"""

from __future__ import annotations

from collections.abc import Mapping
from http import HTTPStatus
from typing import Any

STATUS = "torchserve_status"
"""The reply parameter holding a handler's status for the request (absent: 200)."""


def handler_status(code: Any) -> int:
    """The status a request is answered with, from what its handler set: a whole number
    from 200 to 599, else 500 (a status no HTTP answer can carry is the server's error)."""
    if isinstance(code, int) and not isinstance(code, bool) and 200 <= code <= 599:
        return code
    return int(HTTPStatus.INTERNAL_SERVER_ERROR)


def reply_status(parameters: Mapping[str, Any]) -> int:
    """The status of a reply with ``parameters`` (200 when the handler set none)."""
    return handler_status(parameters.get(STATUS, int(HTTPStatus.OK)))
