"""Triton's response cache, kept in Redis: a request to a model whose configuration says
``response_cache { enable: true }`` is answered from the cache when an identical one was
answered before, without reaching the model.

- **What is identical**: the same tenant (a tenant never sees what another's requests were
  answered: the key starts with the tenant), model and version, the same inputs (names,
  datatypes, shapes and bytes), requested outputs and classification counts, and the same
  request parameters (their values with their types), under the same catalog revision. The
  key is their SHA-256. The revision moves on every load and unload (and on Kubernetes when
  a worker Deployment's rollout ends, :mod:`sluice.scheduler.executor.kubernetes`): an
  answer of a model as it was before one (its weights, its configuration, its ensemble's
  steps) is never served after it.
- **What is kept**: the answer as the worker gave it (its outputs and their bytes), so a
  hit is encoded for each request's own wire (JSON or binary, HTTP or gRPC). Only
  successful answers are kept; requests with inputs or outputs in shared memory regions,
  and those to decoupled and sequence models, bypass the cache.
- **Bounds**: ``SLUICE_RESPONSE_CACHE_BYTES`` for all the answers together (Triton's
  ``--cache-config local,size=N``); storing one evicts the least recently used until it
  fits, and an answer larger than the whole cache is not kept (nor sent to Redis). An
  answer counts with what Redis spends on its keys (:data:`ENTRY_OVERHEAD`), so the room is
  Redis's memory whatever the answers' sizes. An answer unused for
  ``SLUICE_RESPONSE_CACHE_TTL_S`` expires, and the bookkeeping (last use, sizes, total)
  with the last of them. The bookkeeping is updated by Lua scripts, so every gateway
  process, worker and host shares one bounded cache. On a Redis Cluster the cache is split
  in shards by key (``SLUICE_RESPONSE_CACHE_SHARDS``, 16 by default there), each in a slot
  of its own with an equal part of the room and its own eviction order, so that a cached
  model's lookups do not all go to one node.
- **Statistics** as Triton counts them: a hit counts as a successful request and in
  ``cache_hit`` (its lookup's time), not in the inference or execution counts; a miss
  counts in ``cache_miss`` (lookup and insertion).

A Redis error on the way is a miss (the request goes to the model), never a failure.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import logging
import struct
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import orjson
from redis.asyncio import Redis
from redis.exceptions import RedisError

from sluice.core.keys import Keys
from sluice.core.observability.statistics import count_field, ns_field
from sluice.core.redis_client.coalescer import Coalescer
from sluice.core.redis_client.connect import is_cluster_url
from sluice.core.settings import ResponseCacheSettings
from sluice.core.wire import (
    DATA_FIELD,
    HEADER_FIELD,
    MalformedEntry,
    ReplyMessage,
    RequestMessage,
    TensorHeader,
    decode_reply,
    encode_reply,
)

log = logging.getLogger(__name__)

_MAX_EVICTIONS = 64
"""Answers one insertion may evict; beyond that it is not kept (the cache stays bounded)."""

CLUSTER_SHARDS = 16
"""The cache's shards on a Redis Cluster when ``SLUICE_RESPONSE_CACHE_SHARDS`` is 0."""

ENTRY_OVERHEAD = 320
"""What Redis spends on an answer besides the bytes of its value and of its key's name and
digest (counted apart): the key's and its expiry's entries, the index's skiplist node and
the sizes' field, with their allocations (measured: about 560 bytes an answer in all, with
the names). Counting only the values let a cache of small answers take over ten times its
bytes of Redis's memory."""

_REMOVE = """
local function remove(member)
    local size = redis.call('HGET', KEYS[3], member)
    redis.call('DEL', ARGV[5] .. member)
    redis.call('ZREM', KEYS[2], member)
    if size then
        redis.call('HDEL', KEYS[3], member)
        redis.call('DECRBY', KEYS[4], size)
    end
end
"""

_NOW = """
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000000 + tonumber(clock[2])
"""
"""Redis's own clock, in microseconds: one clock for every gateway, and fine enough that
two uses in a row do not tie (the order of use is the eviction order)."""

_GET = (
    _NOW
    + """
local value = redis.call('GET', KEYS[1])
if value then
    redis.call('PEXPIRE', KEYS[1], ARGV[2])
    redis.call('ZADD', KEYS[2], 'XX', now, ARGV[1])
    for i = 2, 4 do
        redis.call('PEXPIRE', KEYS[i], ARGV[2])
    end
end
return value
"""
)
"""KEYS: the answer, the index, the sizes, the total. ARGV: digest, time to live (ms). The
bookkeeping lives as long as the answer used last."""

_PUT = (
    _REMOVE
    + _NOW
    + """
local ttl, limit = tonumber(ARGV[2]), tonumber(ARGV[3])
local size = string.len(ARGV[4]) + tonumber(ARGV[7])
if size > limit then
    return 0
end
local expired = now - ttl * 1000
for _, member in ipairs(redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', expired, 'LIMIT', 0, 64)) do
    remove(member)
end
remove(ARGV[1])
local evicted = 0
while tonumber(redis.call('GET', KEYS[4]) or '0') + size > limit do
    local oldest = redis.call('ZRANGE', KEYS[2], 0, 0)
    if #oldest == 0 or evicted >= tonumber(ARGV[6]) then
        return 0
    end
    remove(oldest[1])
    evicted = evicted + 1
end
redis.call('SET', KEYS[1], ARGV[4], 'PX', ttl)
redis.call('ZADD', KEYS[2], now, ARGV[1])
redis.call('HSET', KEYS[3], ARGV[1], size)
redis.call('INCRBY', KEYS[4], size)
for i = 2, 4 do
    redis.call('PEXPIRE', KEYS[i], ttl)
end
return 1
"""
)
"""KEYS: the answer, the index, the sizes, the total. ARGV: digest, time to live (ms),
the cache's bytes, the answer, the answers' key prefix, the most evictions, the bytes
Redis spends on the answer's keys. The answers unused for the time to live are forgotten
first (their keys expired already), then the least recently used until the new one fits.
The bookkeeping lives as long as the answer kept or used last."""


def digest(
    tenant: str,
    model: str,
    version: int,
    revision: str,
    inputs: Sequence[TensorHeader],
    payload: bytes | memoryview,
    outputs: Sequence[str],
    classes: Mapping[str, int],
    parameters: Mapping[str, Any],
) -> str:
    """The cache key of a request (the work is proportional to its bytes: large ones are
    hashed off the event loop). ``revision``: the catalog's, which every load and unload
    moves."""
    described = orjson.dumps(
        {
            "tenant": tenant,
            "model": model,
            "version": version,
            "revision": revision,
            "inputs": [[t.name, t.datatype, list(t.shape), t.nbytes] for t in inputs],
            "outputs": list(outputs),
            "classes": dict(classes),
            "parameters": {name: _typed(value) for name, value in parameters.items()},
        },
        option=orjson.OPT_SORT_KEYS | orjson.OPT_NON_STR_KEYS,
    )
    hashed = hashlib.sha256(struct.pack(">Q", len(described)))
    hashed.update(described)
    hashed.update(payload)
    return hashed.hexdigest()


def _typed(value: Any) -> Any:
    """A request parameter's value as the key describes it: with its type, and a float
    exactly (JSON writes NaN and both infinities as one ``null``, and a model may tell
    them apart)."""
    if isinstance(value, float):
        return ["float", value.hex()]
    return [type(value).__name__, value]


def pack_answer(reply: ReplyMessage, data: bytes | memoryview) -> bytes:
    """The stored form of an answer: its header's length, its header, its bytes."""
    fields = encode_reply(reply)
    header = fields[HEADER_FIELD]
    return b"".join((struct.pack(">I", len(header)), header, data))


def unpack_answer(value: bytes) -> tuple[ReplyMessage, memoryview]:
    """An answer from its stored form; its bytes are a view of ``value`` (no copy: a hit
    is read on the event loop)."""
    (length,) = struct.unpack_from(">I", value)
    data = cast(bytes, memoryview(value)[4 + length :])  # (decode_reply takes any buffer)
    return decode_reply({HEADER_FIELD: value[4 : 4 + length], DATA_FIELD: data})


_Op = tuple[str, tuple[Any, ...]]


class ResponseCache(Coalescer[_Op, Any]):
    """The cache's commands of all the requests that arrive while one pipeline is in
    flight go together in the next (:class:`sluice.core.redis_client.coalescer.Coalescer`, as the
    appends do), and the statistics they add are summed per counter first: under load a
    hit costs a share of one round trip, not two round trips of its own."""

    what = "the response cache"

    def __init__(
        self, redis: Redis, keys: Keys, limit_bytes: int, ttl_s: float, shards: int = 1
    ) -> None:
        super().__init__()
        self._redis = redis
        self._keys = keys
        self.limit_bytes = limit_bytes
        self.shards = max(1, shards)
        self.shard_bytes = limit_bytes // self.shards
        """The room of each shard: no answer larger than this is kept."""
        self._ttl_ms = max(1, int(ttl_s * 1000))
        self._get_sha = hashlib.sha1(_GET.encode()).hexdigest()
        self._put_sha = hashlib.sha1(_PUT.encode()).hexdigest()
        self._loaded = False

    @classmethod
    def from_settings(
        cls, redis: Redis, keys: Keys, settings: ResponseCacheSettings, redis_url: str
    ) -> ResponseCache | None:
        """The cache ``settings`` ask for (None: no room, no cache)."""
        if not settings.response_cache_bytes:
            return None
        shards = settings.response_cache_shards or (
            CLUSTER_SHARDS if is_cluster_url(redis_url) else 1
        )
        return cls(
            redis,
            keys,
            settings.response_cache_bytes,
            settings.response_cache_ttl_s,
            shards,
        )

    def shard_of(self, key: str) -> int:
        """The shard that keeps the answer of ``key`` (a hex digest)."""
        return int(key[:8], 16) % self.shards if self.shards > 1 else 0

    def overhead(self, key: str) -> int:
        """The bytes an answer kept under ``key`` counts besides its value: its key's name,
        the digest in the index and in the sizes, and :data:`ENTRY_OVERHEAD`."""
        name = self._keys.cached_answer(key, self.shard_of(key))
        return len(name) + 2 * len(key) + ENTRY_OVERHEAD

    def size_of(self, key: str, value: bytes) -> int:
        """The bytes ``value`` counts for in the cache when kept under ``key``."""
        return len(value) + self.overhead(key)

    async def get(self, key: str) -> tuple[ReplyMessage, memoryview] | None:
        """The answer kept under ``key``; None on a miss (or when Redis cannot say)."""
        try:
            value = await self._queue("get", key)
        except RedisError as exc:
            log.debug("response cache lookup failed: %s", exc)
            return None
        if value is None:
            return None
        try:
            return unpack_answer(cast(bytes, value))
        except (MalformedEntry, struct.error) as exc:
            log.warning("dropping a malformed cached answer: %s", exc)
            return None

    async def put(self, key: str, value: bytes) -> bool:
        """Keep ``value`` (:func:`pack_answer`) under ``key``; whether it was kept. One
        larger than a shard's room is refused here: it never crosses to Redis (whose buffers
        would hold it whole before the script refused it)."""
        if self.size_of(key, value) > self.shard_bytes:
            return False
        try:
            return bool(await self._queue("put", key, value))
        except RedisError as exc:
            log.debug("response cache insertion failed: %s", exc)
            return False

    async def count(self, stats_key: str, *, hit: bool, elapsed_ns: int, lookup_ns: int) -> None:
        """Triton's statistics of a hit (a success, and ``cache_hit``) or a miss
        (``cache_miss``), once they are in Redis; best effort."""
        kind = "cache_hit" if hit else "cache_miss"
        fields = {count_field(kind): 1, ns_field(kind): lookup_ns}
        if hit:
            fields |= {count_field("success"): 1, ns_field("success"): elapsed_ns}
            fields[count_field("queue")] = 1
        try:
            await self._queue("count", stats_key, fields)
        except RedisError as exc:
            log.debug("recording the response cache's statistics failed: %s", exc)

    def _queue(self, kind: str, *args: Any) -> asyncio.Future[Any]:
        return self.submit((kind, args))

    async def _send(self, ops: list[_Op]) -> list[Any]:
        """One pipeline for ``ops``: each operation's result, in order (an error for one
        that failed; None for statistics)."""
        if not self._loaded:
            await self._redis.script_load(_GET)
            await self._redis.script_load(_PUT)
            self._loaded = True
        keys = self._keys
        totals: dict[str, dict[str, int]] = {}
        places: list[int | None] = []
        queued = 0
        async with self._redis.pipeline(transaction=False) as pipe:
            for kind, args in ops:
                if kind == "count":
                    stats_key, fields = args
                    summed = totals.setdefault(stats_key, {})
                    for name, value in fields.items():
                        summed[name] = summed.get(name, 0) + value
                    places.append(None)
                    continue
                places.append(queued)
                queued += 1
                key = args[0]
                shard = self.shard_of(key)
                index = keys.cache_index(shard)
                bookkeeping = (index, f"{index}:sizes", f"{index}:total")
                if kind == "get":
                    pipe.evalsha(
                        self._get_sha,
                        4,
                        keys.cached_answer(key, shard),
                        *bookkeeping,
                        key,
                        self._ttl_ms,
                    )
                else:
                    pipe.evalsha(
                        self._put_sha,
                        4,
                        keys.cached_answer(key, shard),
                        *bookkeeping,
                        key,
                        self._ttl_ms,
                        self.shard_bytes,
                        args[1],
                        keys.cached_answer("", shard),
                        _MAX_EVICTIONS,
                        self.overhead(key),
                    )
            for stats_key, summed in totals.items():
                for name, value in summed.items():
                    pipe.hincrby(stats_key, name, value)
                    queued += 1
            if not queued:
                return [None] * len(ops)
            replies = await pipe.execute(raise_on_error=False)
        if any(isinstance(reply, Exception) and "NOSCRIPT" in str(reply) for reply in replies):
            self._loaded = False  # (Redis restarted: loaded again next time)
        return [None if place is None else replies[place] for place in places]


@dataclass(slots=True)
class CacheLookup:
    """One request's way through the cache: its key, and the answer found (a hit)."""

    cache: ResponseCache
    key: str
    started_ns: int
    lookup_ns: int
    hit: tuple[ReplyMessage, memoryview] | None

    @classmethod
    async def start(
        cls,
        cache: ResponseCache,
        tenant: str,
        model: str,
        version: int,
        revision: str,
        message: RequestMessage,
        payload: bytes,
        big: bool,
        offload_bytes: int,
    ) -> CacheLookup:
        """Look the request up under the catalog's ``revision``; the key is computed off the
        event loop when the request is ``big`` (its body: parameters count too) or its
        payload has more than ``offload_bytes`` (JSON numbers take fewer bytes than the
        tensors they make: a small body may make a large payload)."""
        started = time.perf_counter_ns()
        key_of = functools.partial(
            digest,
            tenant,
            model,
            version,
            revision,
            message.inputs,
            payload,
            message.outputs,
            message.classes,
            message.parameters,
        )
        heavy = big or len(payload) > offload_bytes
        key = await asyncio.to_thread(key_of) if heavy else key_of()
        hit = await cache.get(key)
        return cls(cache, key, started, time.perf_counter_ns() - started, hit)

    async def counted(self, stats_key: str) -> None:
        """Record the hit in the model version's statistics."""
        elapsed = time.perf_counter_ns() - self.started_ns
        await self.cache.count(stats_key, hit=True, elapsed_ns=elapsed, lookup_ns=self.lookup_ns)

    async def keep(
        self, reply: ReplyMessage, data: memoryview, offload_bytes: int, stats_key: str
    ) -> None:
        """Keep the model's answer of a miss, and record the miss (lookup and insertion).
        An answer whose bytes alone exceed a shard's room is not even packed."""
        started = time.perf_counter_ns()
        if len(data) < self.cache.shard_bytes:
            if len(data) > offload_bytes:
                value = await asyncio.to_thread(pack_answer, reply, data)
            else:
                value = pack_answer(reply, data)
            await self.cache.put(self.key, value)
        spent = self.lookup_ns + time.perf_counter_ns() - started
        await self.cache.count(stats_key, hit=False, elapsed_ns=0, lookup_ns=spent)
