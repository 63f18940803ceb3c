"""The sequences one instance of a sequence model holds: their implicit state, the control
tensors of each request, and the checkpoints that let the sequence outlive this process.

Every request of a sequence reaches this instance alone (the gateway routes it to the
instance's *slot* stream), so the state in memory is authoritative while the process
lives. Each answer is sent, and then its sequence's checkpoint (the state after that
request) and the acknowledgement of its entry are written in one Redis transaction (both
live in the model's hash slot, so this holds on a Redis Cluster too): the checkpoint and
the acknowledgement happen together or not at all. A worker that replaces a dead one takes
over its unacknowledged entries and restores each sequence from its checkpoint, so every
request changes the state exactly once and the sequence goes on with the results it would
have had; an answer sent just before the worker died is sent again, and the gateway drops
the second. States are small (a model's per-sequence state, typically kilobytes).

A checkpoint expires after the model's ``max_sequence_idle_microseconds``, as the
sequence does: a later request without START gets Triton's error.

A sequence that ENDs (or goes idle) here is *closed*: a request of it without START is
refused from then on, however soon it comes. Its last checkpoint is deleted only with the
END's acknowledgement, after the END's answer went out (and after the next batch may have
started), so the checkpoint alone cannot say that the sequence is over: a closed sequence
is never restored from Redis, until its checkpoint is gone for sure (the END's transaction
went through, or the checkpoint expired).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
from redis.asyncio import Redis
from redis.asyncio.client import Pipeline

from sluice.core.config import ModelConfig, SequenceBatching, SequenceState
from sluice.core.datatypes import numpy_dtype, to_buffer, to_numpy
from sluice.core.errors import InvalidConfig, InvalidInput, SluiceError
from sluice.core.keys import Keys
from sluice.core.sequences import (
    SequenceRef,
    check_corrid,
    corrid_value,
    sequence_of,
    start_missing,
)
from sluice.workers.backends.base import absent_outputs
from sluice.workers.tensors import PendingRequest

INITIAL_STATE_DIR = "initial_state"
MAX_CHECKPOINT_BYTES = 64 << 20
"""A state larger than this is refused (it would not belong in Redis)."""


@dataclass(slots=True)
class Held:
    """One sequence held here: its states (no batch dimension) and when it was last used."""

    states: dict[str, np.ndarray]
    last_seen: float


@dataclass(slots=True)
class Closed:
    """A sequence that ended or went idle here: it is not restored from a checkpoint until
    ``until`` (monotonic seconds; by then every checkpoint it had expired), or until the
    transaction of ``entry_id`` (its END) deleted the checkpoint."""

    until: float
    entry_id: bytes | None


@dataclass
class SequenceBook:
    config: ModelConfig
    model_dir: Path
    redis: Redis
    keys: Keys
    version: int
    _held: dict[str, Held] = field(default_factory=dict)
    """By key, least recently used first: the idle ones are found at the front, however many
    sequences are held."""
    _checkpoints: dict[bytes, bytes | None] = field(default_factory=dict)
    """Entry id -> the checkpoint its answer carries (None: the sequence ended)."""
    _initial: dict[str, np.ndarray] = field(default_factory=dict)
    _closed: dict[str, Closed] = field(default_factory=dict)
    """Sequences that ended or went idle here, by key (see :class:`Closed`), the earliest
    ``until`` first."""
    _lock: threading.Lock = field(default_factory=threading.Lock)
    """Guards ``_checkpoints`` and ``_closed`` (the compute thread and the event loop)."""

    def __post_init__(self) -> None:
        batching = self.batching
        self._initial = {s.input_name: self._initial_state(s) for s in batching.states}

    @property
    def batching(self) -> SequenceBatching:
        assert self.config.sequence_batching is not None
        return self.config.sequence_batching

    @property
    def idle_s(self) -> float:
        return self.batching.max_sequence_idle_us / 1e6

    def _initial_state(self, state: SequenceState) -> np.ndarray:
        dims = state.initial_dims or tuple(1 if d < 0 else d for d in state.dims)
        dtype = numpy_dtype(state.datatype)
        if not state.initial_file:
            if state.datatype == "BYTES":
                return np.full(dims, b"", dtype=object)
            return np.zeros(dims, dtype)
        path = self.model_dir / INITIAL_STATE_DIR / state.initial_file
        label = f"state '{state.input_name}': initial_state data_file '{state.initial_file}'"
        if path.is_symlink() or not path.is_file():
            raise InvalidConfig(f"model '{self.config.name}': {label} is not a regular file")
        data = path.read_bytes()
        try:
            return to_numpy(state.datatype, dims, data).copy()
        except (ValueError, SluiceError) as exc:
            raise InvalidConfig(f"model '{self.config.name}': {label}: {exc}") from None

    # -- before a batch (event loop) -------------------------------------------------------

    def ref(self, request: PendingRequest) -> SequenceRef:
        """The request's sequence (its tenant's: see :attr:`SequenceRef.key`)."""
        return sequence_of(request.message.parameters, self.config.name, request.message.tenant)

    async def admit(
        self, batch: list[PendingRequest]
    ) -> tuple[list[PendingRequest], list[tuple[PendingRequest, SluiceError]]]:
        """The requests that can run (their sequence is held here, starts, or is restored
        from its checkpoint) and those that fail, with why."""
        now = time.monotonic()
        self._forget_idle(now)
        refs: dict[bytes, SequenceRef] = {}
        failed: list[tuple[PendingRequest, SluiceError]] = []
        for request in batch:
            try:
                ref = self.ref(request)
                check_corrid(ref, self.batching, self.config.name)
            except InvalidInput as exc:
                failed.append((request, exc))
            else:
                refs[request.entry_id] = ref
        with self._lock:
            unknown = {
                ref.key
                for ref in refs.values()
                if not ref.start and ref.key not in self._held and ref.key not in self._closed
            }
        if unknown:
            await self._restore(sorted(unknown), now)
        admitted: list[PendingRequest] = []
        for request in batch:
            if request.entry_id not in refs:
                continue
            ref = refs[request.entry_id]
            held = self._held.pop(ref.key, None)
            if ref.start:
                with self._lock:
                    self._closed.pop(ref.key, None)
                held = Held({name: value.copy() for name, value in self._initial.items()}, now)
            elif held is None:
                failed.append((request, start_missing(ref, self.config.name)))
                continue
            held.last_seen = now
            self._held[ref.key] = held  # (the most recently used: last)
            admitted.append(request)
        return admitted, failed

    def _forget_idle(self, now: float) -> None:
        """Sequences idle longer than the model allows are over (closed: their checkpoint,
        which may outlive them by a moment, does not bring them back). Both books are in
        time order, so this looks at the expired entries and one more, not at every
        sequence held (a client may open thousands and never end them)."""
        idle: list[str] = []
        for key, held in self._held.items():
            if now - held.last_seen <= self.idle_s:
                break
            idle.append(key)
        with self._lock:
            for key in idle:
                del self._held[key]
                self._close(key, Closed(now + self.idle_s, None))
            while self._closed:
                key, closed = next(iter(self._closed.items()))
                if closed.until >= now:
                    break
                del self._closed[key]

    def _close(self, key: str, closed: Closed) -> None:
        """Record ``key`` as closed, last in the closed book's order (``_lock`` held)."""
        self._closed.pop(key, None)
        self._closed[key] = closed

    async def _restore(self, keys: list[str], now: float) -> None:
        names = [self.keys.sequence_state(self.config.name, self.version, key) for key in keys]
        values = await self.redis.mget(names)
        for key, raw in zip(keys, values, strict=True):
            if isinstance(raw, bytes) and raw:
                states = _decode(raw)
                if states is not None:
                    self._held[key] = Held(states, now)

    # -- around the compute (compute thread) -----------------------------------------------

    def inputs(self, batch: list[PendingRequest]) -> dict[str, np.ndarray]:
        """The control and state inputs of ``batch``, one row per request."""
        batched = self.config.max_batch_size > 0
        refs = [self.ref(request) for request in batch]
        tensors: dict[str, np.ndarray] = {}
        for control in self.batching.controls:
            dtype = numpy_dtype(control.datatype)
            if control.kind == "CORRID":  # (ids it cannot hold were refused by admit)
                values = [corrid_value(ref.id, control.datatype) for ref in refs]
                column = np.array(values, dtype=object if control.datatype == "BYTES" else dtype)
            else:
                on = {"START": [r.start for r in refs], "END": [r.end for r in refs]}.get(
                    control.kind, [True] * len(refs)
                )
                column = np.array(
                    [control.true_value if flag else control.false_value for flag in on],
                    dtype=dtype,
                )
            tensors[control.name] = column.reshape(len(batch), 1) if batched else column[:1]
        for state in self.batching.states:
            rows = [self._held[ref.key].states[state.input_name] for ref in refs]
            if any(row.shape != rows[0].shape for row in rows):
                raise InvalidInput("sequences of different state shapes cannot share a batch")
            tensors[state.input_name] = np.stack(rows) if batched else rows[0]
        return tensors

    @property
    def state_outputs(self) -> list[str]:
        return [state.output_name for state in self.batching.states]

    def update(self, batch: list[PendingRequest], outputs: dict[str, np.ndarray]) -> None:
        """Take the state outputs out of ``outputs`` (those the config also declares as
        outputs stay, to be answered): they become each sequence's state, and its checkpoint
        (or its end) is what the request's answer will carry. An END closes its sequence."""
        batched = self.config.max_batch_size > 0
        returned: dict[str, np.ndarray] = {}
        for state in self.batching.states:
            name = state.output_name
            if name not in outputs:
                continue  # the model did not give it: the states stay as they were
            # A state output that is also a declared output is answered too (as Triton does).
            declared = self.config.output(name) is not None
            returned[name] = outputs[name] if declared else outputs.pop(name)
        absent = absent_outputs(outputs)
        for index, request in enumerate(batch):
            ref = self.ref(request)
            held = self._held.get(ref.key)
            if held is None:
                continue
            lacking = absent.get(index, frozenset())
            for state in self.batching.states:
                value = returned.get(state.output_name)
                if value is None or state.output_name in lacking:
                    continue
                row = value[index] if batched else value
                held.states[state.input_name] = np.array(row, dtype=numpy_dtype(state.datatype))
            with self._lock:
                self._checkpoints[request.entry_id] = None if ref.end else _encode(held.states)
                if ref.end:
                    # Closed before its answer goes out: a request that follows the END,
                    # however soon, finds it closed (its checkpoint is still in Redis).
                    until = time.monotonic() + self.idle_s
                    self._close(ref.key, Closed(until, request.entry_id))
            if ref.end:
                self._held.pop(ref.key, None)

    # -- with the answers (event loop) -----------------------------------------------------

    def write_checkpoints(self, pipe: Pipeline, requests: list[PendingRequest]) -> None:
        """Queue the checkpoints of the answered ``requests`` on ``pipe`` (a transaction
        that also acknowledges them)."""
        idle_ms = max(1, self.batching.max_sequence_idle_us // 1000)
        for request in requests:
            with self._lock:
                if request.entry_id not in self._checkpoints:
                    continue
                checkpoint = self._checkpoints[request.entry_id]
            key = self.keys.sequence_state(self.config.name, self.version, self.ref(request).key)
            if checkpoint is None:
                pipe.delete(key)
            else:
                pipe.set(key, checkpoint, px=idle_ms)

    def published(self, requests: list[PendingRequest]) -> None:
        """Forget the checkpoints of requests whose answers (and checkpoints) went out; a
        sequence whose END's transaction deleted its checkpoint needs no closing any more
        (nothing is left to restore)."""
        with self._lock:
            for request in requests:
                checkpoint = self._checkpoints.pop(request.entry_id, b"")
                if checkpoint is not None:
                    continue
                key = self.ref(request).key
                closed = self._closed.get(key)
                if closed is not None and closed.entry_id == request.entry_id:
                    del self._closed[key]


def _encode(states: dict[str, np.ndarray]) -> bytes:
    packed = {name: _pack(array) for name, array in states.items()}
    data: bytes = msgpack.packb(packed)
    if len(data) > MAX_CHECKPOINT_BYTES:
        raise InvalidInput(f"a sequence's state of {len(data)} bytes is too large to checkpoint")
    return data


def _pack(array: np.ndarray) -> list[Any]:
    if array.dtype == object:
        return ["BYTES", list(array.shape), bytes(to_buffer("BYTES", array))]
    return [array.dtype.str, list(array.shape), array.tobytes()]


def _decode(raw: bytes) -> dict[str, np.ndarray] | None:
    """The states of a checkpoint; None when it is not one (written by something else)."""
    try:
        packed = msgpack.unpackb(raw)
        states: dict[str, np.ndarray] = {}
        for name, (dtype, shape, data) in packed.items():
            if dtype == "BYTES":
                states[name] = to_numpy("BYTES", shape, data).copy()
            elif np.dtype(dtype).kind not in "biuf":
                return None
            else:
                states[name] = np.frombuffer(data, dtype=np.dtype(dtype)).reshape(shape).copy()
        return states
    except (ValueError, TypeError, msgpack.UnpackException, SluiceError):
        return None
