"""Feeding rows to a model version through its background stream, and collecting the answers.

A shard sends its rows in requests of ``rows_per_request`` rows, keeps at most ``in_flight``
of them queued, and reads the answers from a reply stream of its own (one per attempt), so
no gateway is involved and nothing else reads them. The background stream is served only
when no online request waits: online traffic keeps precedence over a running batch.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
from redis import Redis

from sluice.core.clock import CLOCK
from sluice.core.config import ModelConfig
from sluice.core.datatypes import deserialize_bytes, from_numpy_dtype, numpy_dtype, serialize_bytes
from sluice.core.errors import InvalidInput, SluiceError
from sluice.core.keys import Keys
from sluice.core.queue_streams import register_sync
from sluice.core.wire import RequestMessage, TensorHeader, decode_reply, encode_request

_READ_BLOCK_MS = 500
_CANCEL_CHECK_S = 1.0


class ShardFailed(SluiceError):
    """A request of the shard was answered with an error, or not answered in time."""


class Cancelled(Exception):
    """The batch was cancelled while the shard ran."""


@dataclass
class Feeder:
    redis: Redis
    keys: Keys
    config: ModelConfig
    version: int
    reply_stream: str
    rows_per_request: int
    in_flight: int
    timeout_s: float
    request_prefix: str
    """Prefix of each request's id (batch, shard, attempt), for logs and traces."""
    progress: Callable[[int], None] = lambda rows: None
    cancelled: Callable[[], bool] = lambda: False
    tenant: str = ""
    """The batch job's owner: its requests go to that tenant's background stream ("": the
    base one), so that the workers share the background level between tenants."""
    _next_check: float = field(default=0.0, init=False)

    @property
    def stream(self) -> str:
        return self.keys.background_stream(self.config.name, self.version, self.tenant)

    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The model's outputs for every row of ``inputs``, in row order."""
        rows = len(next(iter(inputs.values()))) if inputs else 0
        step = max(1, self.rows_per_request)
        chunks = [(start, min(start + step, rows)) for start in range(0, rows, step)]
        outputs: dict[str, np.ndarray] = {}
        sent: dict[str, tuple[int, int, float]] = {}
        next_chunk = 0
        last_id = "0-0"
        try:
            while next_chunk < len(chunks) or sent:
                if next_chunk < len(chunks) and len(sent) < self.in_flight:
                    count = min(self.in_flight - len(sent), len(chunks) - next_chunk)
                    self._send(inputs, chunks, next_chunk, count, sent)
                    next_chunk += count
                found = cast(
                    list[Any],
                    self.redis.xread({self.reply_stream: last_id}, count=256, block=_READ_BLOCK_MS),
                )
                for _, entries in found or []:
                    for entry_id, fields in entries:
                        last_id = entry_id.decode()
                        self._place(fields, sent, outputs, rows)
                self._check(sent)
        finally:
            self.redis.delete(self.reply_stream)
        return outputs

    def _send(
        self,
        inputs: dict[str, np.ndarray],
        chunks: list[tuple[int, int]],
        first: int,
        count: int,
        sent: dict[str, tuple[int, int, float]],
    ) -> None:
        CLOCK.sync_blocking(self.redis)  # (the workers may run on other hosts)
        if first == 0:
            register_sync(self.redis, self.keys, self.config.name, self.version, self.stream)
        now_ns = CLOCK.now_ns()
        with self.redis.pipeline(transaction=False) as pipe:
            for index in range(first, first + count):
                start, end = chunks[index]
                headers: list[TensorHeader] = []
                parts: list[bytes] = []
                for name, array in inputs.items():
                    part = array[start:end]
                    datatype = self._datatype(name, part)
                    data = (
                        serialize_bytes(part.reshape(-1))
                        if datatype == "BYTES"
                        else np.ascontiguousarray(part).tobytes()
                    )
                    headers.append(TensorHeader(name, datatype, tuple(part.shape), len(data)))
                    parts.append(data)
                key = str(index)
                message = RequestMessage(
                    request_key=key,
                    reply_to=self.reply_stream,
                    inputs=headers,
                    outputs=[o.name for o in self.config.outputs],
                    deadline_ns=now_ns + int(self.timeout_s * 1e9),
                    enqueued_ns=now_ns,
                    request_id=f"{self.request_prefix}-{index}",
                    tenant=self.tenant,
                )
                pipe.xadd(self.stream, encode_request(message, b"".join(parts)))  # type: ignore[arg-type]
                sent[key] = (start, end, time.monotonic())
            pipe.execute()

    def _datatype(self, name: str, part: np.ndarray) -> str:
        spec = self.config.input(name)
        if spec is not None:
            return spec.datatype
        return from_numpy_dtype(part.dtype)

    def _place(
        self,
        fields: dict[bytes, bytes],
        sent: dict[str, tuple[int, int, float]],
        outputs: dict[str, np.ndarray],
        rows: int,
    ) -> None:
        reply, data = decode_reply(fields)
        chunk = sent.pop(reply.request_key, None)
        if chunk is None:
            return  # a duplicate answer (the request was delivered twice)
        start, end, _ = chunk
        if reply.error_kind:
            raise ShardFailed(f"rows {start}..{end - 1}: {reply.error}")
        offset = 0
        for header in reply.outputs:
            chunk_bytes = data[offset : offset + header.nbytes]
            offset += header.nbytes
            if header.datatype == "BYTES":
                elements = deserialize_bytes(chunk_bytes)
                values = np.empty(len(elements), dtype=object)
                values[:] = elements
                array = values.reshape(header.shape)
            else:
                dtype = numpy_dtype(header.datatype)
                array = np.frombuffer(chunk_bytes, dtype=dtype).reshape(header.shape)
            target = outputs.get(header.name)
            if target is None:
                target = np.empty((rows, *header.shape[1:]), dtype=array.dtype)
                outputs[header.name] = target
            if target.shape[1:] != array.shape[1:]:
                raise InvalidInput(
                    f"output '{header.name}' changes shape between requests "
                    f"({list(target.shape[1:])} and {list(array.shape[1:])}): a batch job "
                    "writes fixed-size rows"
                )
            target[start:end] = array
        self.progress(end - start)

    def _check(self, sent: dict[str, tuple[int, int, float]]) -> None:
        now = time.monotonic()
        for start, end, at in sent.values():
            if now - at > self.timeout_s + 5:
                raise ShardFailed(
                    f"rows {start}..{end - 1}: no answer within {self.timeout_s:.0f} s"
                )
        if now >= self._next_check:
            self._next_check = now + _CANCEL_CHECK_S
            if self.cancelled():
                raise Cancelled()
