"""Commands written to Redis at once, not a turn of the event loop later.

redis-py's asyncio connection writes every command inside ``asyncio.wait_for(write,
socket_timeout)``. On Python 3.11 ``wait_for`` runs what it waits for as a task of its
own, so each command (a pipeline too) waits for the next turn of the event loop before its
bytes go out, and costs a task and a timer: a few of each per request on every process.
On a worker at low rates that turn also let its next blocking read go out before the
answers of the batch it had just computed, which then waited for it.

Here a command's bytes are handed to the socket at once. Only a write the socket cannot
take yet (its buffer not empty after the write) goes through redis-py's own path, which
waits for it under the connection's timeout and handles its errors; so does every write
on a connection that is not open, or whose health check is due.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from redis.asyncio.connection import (
    AbstractConnection,
    Connection,
    SSLConnection,
    UnixDomainSocketConnection,
    parse_url,
)


class _WritesAtOnce(AbstractConnection):
    async def send_packed_command(
        self, command: bytes | str | Iterable[bytes], check_health: bool = True
    ) -> None:
        if check_health and self.is_connected:
            # (returns at once unless a health check is due)
            await self.check_health()  # type: ignore[no-untyped-call]
        writer = self._writer
        if not self.is_connected or writer is None or writer.transport.is_closing():
            await super().send_packed_command(command, check_health)
            return
        if isinstance(command, str):
            command = command.encode()
        writer.writelines([command] if isinstance(command, bytes) else command)
        if writer.transport.get_write_buffer_size():
            # (nothing more to write: it waits for the socket, with redis-py's timeout)
            await super().send_packed_command([], check_health=False)


class PromptConnection(_WritesAtOnce, Connection):
    """A TCP connection whose commands are written at once."""


class PromptSSLConnection(_WritesAtOnce, SSLConnection):
    """A TLS connection whose commands are written at once."""


class PromptUnixConnection(_WritesAtOnce, UnixDomainSocketConnection):
    """A Unix socket connection whose commands are written at once."""


_PROMPT: dict[type[AbstractConnection], type[AbstractConnection]] = {
    Connection: PromptConnection,
    SSLConnection: PromptSSLConnection,
    UnixDomainSocketConnection: PromptUnixConnection,
}


def prompt_class(connection_class: Any) -> Any:
    """The prompt variant of one of redis-py's connection classes (another one unchanged)."""
    return _PROMPT.get(connection_class, connection_class)


def prompt_class_for(url: str) -> type[AbstractConnection]:
    """The prompt connection class for a ``redis://``, ``rediss://`` or ``unix://`` URL."""
    connection_class = parse_url(url).get("connection_class", Connection)
    return prompt_class(connection_class)  # type: ignore[no-any-return]
