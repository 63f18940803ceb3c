"""uvicorn's httptools protocol with time limits on slow clients and a connection cap.

uvicorn bounds only the idle time between requests on a kept-alive connection. A client
that opens connections and sends nothing, or sends its headers one byte at a time, or
never reads its response, would hold a connection (and its memory) forever. Each
connection here has at most one timer running, for the phase it is in:

- waiting for a request's headers (from the connection's start, or from the first byte
  of the next request): ``header_timeout_s``, then ``408`` and close;
- waiting for the rest of the body once the headers are in: ``body_timeout_s``, then
  close (the application sees a disconnect); for an upload (``POST /v2/uploads``, a file
  of up to gigabytes) the time counts from the last bytes received instead. The clock
  stops while the server itself has stopped reading (the application has not yet taken
  what is buffered): a busy server does not cut off a client that sent in time;
- writing a response the client does not read (the transport's buffer stays full):
  ``send_timeout_s``, then close.

While the application computes the answer no timer runs: the request's own deadline
bounds that. A client that goes away meanwhile cancels the task a route left in the scope
under :data:`CANCEL_ON_DISCONNECT` (an inference waiting for its answer), so its request
is taken back from the queue instead of computed for nobody. Connections beyond
``max_connections`` are closed as soon as they open.

uvicorn writes a response's head and its body in two calls, so two packets and two
wake-ups of the client for every small answer; here they go out in one write
(:class:`OneWriteTransport`).

A request with both ``Transfer-Encoding: chunked`` and ``Content-Length`` (what
``requests`` sends for a body the caller chunked itself; Triton reads it) is read by its
chunks, the length ignored, as RFC 9112 section 6.3 allows; and, as it requires, the
connection closes after the answer, so no byte after that body is read as a request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any, cast

from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from sluice.gateway.inference.response import encode_error

log = logging.getLogger(__name__)


def _closing_response(status: str, message: str) -> bytes:
    """A whole ``{"error": ...}`` response written by the protocol itself, before or
    instead of the application; the connection closes after it."""
    body = encode_error(message)
    head = (
        f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\n"
        f"connection: close\r\ncontent-length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


CANCEL_ON_DISCONNECT = "sluice.cancel_on_disconnect"
"""Scope key of the task to cancel when the client goes away before its response starts."""

DISCONNECTED = "sluice.disconnected"
"""Scope key set (True) when that task was cancelled because the client went away."""


def cancel_on_disconnect(scope: Any) -> None:
    """Let a client that goes away before its response starts cancel the current task (a
    route awaiting an inference): the outermost application swallows that cancellation."""
    scope[CANCEL_ON_DISCONNECT] = asyncio.current_task()


_COMBINE_MAX_BYTES = 64 * 1024
"""A body up to this size is copied behind its head; a larger one goes in its own write."""


class OneWriteTransport:
    """The transport a request's cycle writes to: a response's head is held until its body
    is written in the same turn of the event loop, and both go in one write. Whatever is
    held at the end of that turn (a body-less answer, a streamed one) is written then."""

    __slots__ = ("_held", "_loop", "_transport")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._held: bytes | None = None

    def write(self, data: bytes) -> None:
        held = self._held
        if held is not None:
            self._held = None
            if len(data) <= _COMBINE_MAX_BYTES:
                self._transport.write(held + data)
                return
            self._transport.write(held)
            self._transport.write(data)
        elif data.startswith(b"HTTP/1.1 ") and not data.startswith(b"HTTP/1.1 100 "):
            self._held = data
            self._loop.call_soon(self.flush)
        else:
            self._transport.write(data)

    def flush(self) -> None:
        held, self._held = self._held, None
        if held is not None and not self._transport.is_closing():
            self._transport.write(held)

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class _ReadingFlow(FlowControl):
    """uvicorn's flow control, telling the protocol when reading stops and starts again."""

    def __init__(self, transport: asyncio.Transport, protocol: BoundedHttpToolsProtocol) -> None:
        super().__init__(transport)
        self._protocol = protocol

    def pause_reading(self) -> None:
        if not self.read_paused:
            super().pause_reading()
            self._protocol.reading_paused()

    def resume_reading(self) -> None:
        if self.read_paused:
            super().resume_reading()
            self._protocol.reading_resumed()


class BoundedHttpToolsProtocol(HttpToolsProtocol):
    """Set as ``uvicorn.Config(http=...)`` through :func:`bounded_protocol`."""

    header_timeout_s = 10.0
    body_timeout_s = 60.0
    send_timeout_s = 60.0
    max_connections = 4096

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Chunked with a Content-Length too: by the chunks (on_headers_complete closes after).
        with contextlib.suppress(AttributeError):  # httptools < 0.6.2: refused (400), as before
            self.parser.set_dangerous_leniencies(lenient_chunked_length=True)
        self._timer: asyncio.TimerHandle | None = None
        self._phase = ""
        self._idle_body = False
        """An upload's body: its timeout counts from the last bytes received."""
        self._body_left_s: float | None = None
        """The body's time left while the server does not read (its clock stopped)."""

    def _arm(self, phase: str, timeout_s: float) -> None:
        self._disarm()
        self._phase = phase
        self._timer = self.loop.call_later(timeout_s, self._expired)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._phase = ""
        self._body_left_s = None

    def _arm_body(self, timeout_s: float) -> None:
        """The body's clock: running while the server reads, stopped while it does not."""
        self._arm("body", timeout_s)
        if self.flow.read_paused:
            self.reading_paused()

    def reading_paused(self) -> None:
        """Reading stopped (the application has not taken what is buffered, or an earlier
        request on this connection is still being answered): the body's clock stops."""
        if self._phase == "body" and self._timer is not None:
            self._body_left_s = max(0.0, self._timer.when() - self.loop.time())
            self._timer.cancel()
            self._timer = None

    def reading_resumed(self) -> None:
        if self._phase == "body" and self._body_left_s is not None:
            left = self.body_timeout_s if self._idle_body else self._body_left_s
            self._arm_body(left)

    def _expired(self) -> None:
        self._timer = None
        if self.transport.is_closing():
            return
        log.debug("closing a connection from %s: %s too slow", self.client, self._phase)
        if self._phase == "headers":
            message = f"request headers not received within {self.header_timeout_s:g} s"
            self.transport.write(_closing_response("408 Request Timeout", message))
            self.transport.close()
        else:  # drop what is buffered for a client that does not read
            self.transport.abort()

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to a request it cannot parse, as JSON like every other error."""
        self._disarm()
        self.transport.write(_closing_response("400 Bad Request", f"malformed HTTP request: {msg}"))
        self.transport.close()

    # -- asyncio.Protocol ------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.flow = _ReadingFlow(transport, self)
        if len(self.connections) > self.max_connections:
            log.warning("refusing a connection: %d are open already", self.max_connections)
            transport.abort()
            return
        self._arm("headers", self.header_timeout_s)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        cycle = self.cycle
        if cycle is not None and not cycle.response_started:
            scope = cast(dict[str, Any], cycle.scope)
            task = scope.get(CANCEL_ON_DISCONNECT)
            if isinstance(task, asyncio.Task) and not task.done():
                scope[DISCONNECTED] = True
                task.cancel()
        super().connection_lost(exc)

    def pause_writing(self) -> None:
        super().pause_writing()
        self._arm("reading of the response", self.send_timeout_s)

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._phase == "reading of the response":
            self._disarm()

    # -- httptools parser callbacks ----------------------------------------------------------

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._timer is None:  # the next request on a kept-alive connection
            self._arm("headers", self.header_timeout_s)

    def on_headers_complete(self) -> None:
        super().on_headers_complete()
        if self.cycle is not None:
            self.cycle.transport = OneWriteTransport(self.transport, self.loop)  # type: ignore[assignment]
            if _chunked_with_length(self.headers):
                self.cycle.keep_alive = False  # answered with "connection: close", then closed
        scope = self.scope
        self._idle_body = scope.get("method") == "POST" and scope.get("path", "").startswith(
            "/v2/uploads"
        )
        self._arm_body(self.body_timeout_s)

    def on_body(self, body: bytes) -> None:
        super().on_body(body)
        if self._idle_body and self._phase == "body" and self._timer is not None:
            self._arm_body(self.body_timeout_s)

    def on_message_complete(self) -> None:
        super().on_message_complete()
        if self._phase in ("headers", "body"):
            self._disarm()


def _chunked_with_length(headers: list[tuple[bytes, bytes]]) -> bool:
    names = {name for name, _ in headers}
    return b"transfer-encoding" in names and b"content-length" in names


def bounded_protocol(
    *, header_timeout_s: float, body_timeout_s: float, send_timeout_s: float, max_connections: int
) -> type[BoundedHttpToolsProtocol]:
    """A protocol class carrying these limits (uvicorn instantiates it per connection)."""
    return type(
        "BoundedHttpToolsProtocol",
        (BoundedHttpToolsProtocol,),
        {
            "header_timeout_s": header_timeout_s,
            "body_timeout_s": body_timeout_s,
            "send_timeout_s": send_timeout_s,
            "max_connections": max_connections,
        },
    )
