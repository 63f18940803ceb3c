"""Feeding rows to a model version through its background stream, and collecting the answers.

A shard sends its rows in requests of ``rows_per_request`` rows, keeps at most ``in_flight``
of them queued, and reads the answers from a reply stream of its own (one per attempt), so
no gateway is involved and nothing else reads them. The background stream is served only
when no online request waits: online traffic keeps precedence over a running batch.

A run that stops before every answer is in (the batch cancelled, a request failed or never
answered) withdraws its requests still out, as a gateway does for a caller gone
(:mod:`sluice.core.cancellation`): no worker computes them for nobody. The reply stream is
made with the first requests and always carries an expiry (renewed while the shard runs,
:data:`REPLY_GRACE_S` once it is closed), so that an answer arriving late (a request already
computing, one delivered twice, one of an attempt whose batch worker was killed) lands in a
stream that goes away, not in one made anew that would stay for good.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
from redis import Redis
from redis.exceptions import RedisError

from sluice.core.cancellation import NOTICES_MAX_LEN, notice_fields
from sluice.core.clock import CLOCK
from sluice.core.config import ModelConfig
from sluice.core.datatypes import deserialize_bytes, from_numpy_dtype, numpy_dtype, serialize_bytes
from sluice.core.errors import InvalidInput, SluiceError
from sluice.core.keys import Keys
from sluice.core.queue_streams import register_sync
from sluice.core.wire import RequestMessage, TensorHeader, decode_reply, encode_request

log = logging.getLogger("batch")

_READ_BLOCK_MS = 500
_CANCEL_CHECK_S = 1.0

REPLY_GRACE_S = 300
"""How long a shard's reply stream outlives its last renewal (its shard closed, or its
batch worker gone): past it, an answer can only belong to a request nobody waits for."""

_MARKER = b"sluice-open"
"""The field of the entry that makes a reply stream exist before any answer (so that its
expiry holds from the start); readers skip it."""


class ShardFailed(SluiceError):
    """A request of the shard was answered with an error, or not answered in time."""


class RequestFailed(ShardFailed):
    """A request was answered with an error: the fault of its rows (their data, or the
    model on them), not of the shard. ``error`` is the answer's message."""

    def __init__(self, message: str, error: str) -> None:
        super().__init__(message)
        self.error = error


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
    _last_id: str = field(default="0-0", init=False)
    """The last entry read from the reply stream (runs go on from it: a late answer to an
    earlier run is never read as one of a later run's)."""
    _serial: int = field(default=0, init=False)
    """Requests sent so far, by all runs: each request's key is its number, never reused."""
    _entries: dict[str, bytes] = field(default_factory=dict, init=False)
    """Each request still out -> its entry in the model's stream (what withdraws it)."""

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
        try:
            while next_chunk < len(chunks) or sent:
                if next_chunk < len(chunks) and len(sent) < self.in_flight:
                    count = min(self.in_flight - len(sent), len(chunks) - next_chunk)
                    self._send(inputs, chunks, next_chunk, count, sent)
                    next_chunk += count
                found = cast(
                    list[Any],
                    self.redis.xread(
                        {self.reply_stream: self._last_id}, count=256, block=_READ_BLOCK_MS
                    ),
                )
                for _, entries in found or []:
                    for entry_id, fields in entries:
                        self._last_id = entry_id.decode()
                        if _MARKER not in fields:
                            self._place(fields, sent, outputs, rows)
                self._check(sent)
        finally:
            if sent:
                self._withdraw(sent)
        return outputs

    def close(self) -> None:
        """The shard is done with this feeder: its reply stream expires
        :data:`REPLY_GRACE_S` from now (and holds whatever answer comes late until then)."""
        self._keep_replies(REPLY_GRACE_S)

    def _keep_replies(self, ttl_s: float) -> None:
        """Make the reply stream exist (a marker entry, which readers skip) and expire
        ``ttl_s`` from now."""
        with self.redis.pipeline(transaction=False) as pipe:
            pipe.xadd(self.reply_stream, {_MARKER: b"1"}, maxlen=1)
            pipe.expire(self.reply_stream, max(1, int(ttl_s)))
            pipe.execute()

    def _withdraw(self, sent: dict[str, tuple[int, int, float]]) -> None:
        """Take the requests still out off the model's queue, and tell the workers that may
        hold one already to drop it (best effort: their deadlines still bound them)."""
        notices = self.keys.cancellations(self.config.name)
        try:
            with self.redis.pipeline(transaction=False) as pipe:
                for key in sent:
                    entry = self._entries.pop(key, None)
                    if entry is not None:
                        pipe.xdel(self.stream, entry)
                    pipe.xadd(
                        notices,
                        notice_fields(self.reply_stream, key),  # type: ignore[arg-type]
                        maxlen=NOTICES_MAX_LEN,
                        approximate=True,
                    )
                pipe.execute()
        except RedisError as exc:
            log.warning("withdrawing %d batch requests failed: %s", len(sent), exc)
        sent.clear()

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
        if self._serial == 0:
            self._keep_replies(self._ttl_s)
        now_ns = CLOCK.now_ns()
        keys: list[str] = []
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
                key = str(self._serial)
                self._serial += 1
                keys.append(key)
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
            entries = pipe.execute()
        self._entries.update(zip(keys, cast(list[bytes], entries), strict=True))

    @property
    def _ttl_s(self) -> float:
        """The reply stream's expiry while the shard runs: past every request's deadline."""
        return self.timeout_s + REPLY_GRACE_S

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
            return  # a duplicate answer (the request was delivered twice), or a late one
        self._entries.pop(reply.request_key, None)
        start, end, _ = chunk
        if reply.error_kind:
            raise RequestFailed(f"rows {start}..{end - 1}: {reply.error}", reply.error)
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
            self.redis.expire(self.reply_stream, int(self._ttl_s))
            if self.cancelled():
                raise Cancelled()
