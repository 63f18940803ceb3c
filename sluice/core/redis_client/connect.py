"""Redis clients from ``SLUICE_REDIS_URL``: one Redis, or a Redis Cluster.

``redis://host:port/db`` (``rediss://`` with TLS) is one server; ``redis+cluster://host:port``
(``rediss+cluster://``) is any node of a Redis Cluster, and redis-py's cluster client finds
the others, follows slot moves and fails over with the cluster. Both clients answer the same
commands; what differs is that a multi-key command, script or transaction must stay within
one hash slot, which the key layout (:mod:`sluice.core.keys`) ensures.

The rest of Sluice types the cluster client as the plain one: it is used only through the
commands both share. One more difference is smoothed over: when the cluster cannot serve a
command (a slot without a primary during a failover, no node reachable), redis-py raises
``RedisClusterException``, which is no ``RedisError``; here it becomes
:class:`ClusterUnavailable`, a connection error, so that everything Sluice does when Redis
is unreachable (a 503, a retry, a warning and the loop goes on) applies to a cluster too.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, TypeVar, cast

from redis import Redis
from redis.asyncio import Redis as AsyncRedis
from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster
from redis.cluster import RedisCluster
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import (
    CrossSlotTransactionError,
    InvalidPipelineStack,
    RedisClusterException,
)

from sluice.core.redis_client.prompt import prompt_class, prompt_class_for

T = TypeVar("T")


class ClusterUnavailable(RedisConnectionError):
    """A Redis Cluster cannot serve a command now (redis-py's ``RedisClusterException``)."""


def _unavailable(exc: RedisClusterException) -> Exception:
    if isinstance(exc, CrossSlotTransactionError | InvalidPipelineStack):
        return exc  # a mistake in the caller, not the cluster's state: left as it is
    return ClusterUnavailable(f"Redis Cluster: {exc}")


@contextlib.contextmanager
def _cluster_errors() -> Iterator[None]:
    try:
        yield
    except RedisClusterException as exc:
        raise _unavailable(exc) from exc


def _translated(call: Callable[..., T]) -> Callable[..., T]:
    @functools.wraps(call)
    def run(*args: Any, **kwargs: Any) -> T:
        with _cluster_errors():
            return call(*args, **kwargs)

    return run


def _translated_async(call: Callable[..., Awaitable[T]]) -> Callable[..., Awaitable[T]]:
    @functools.wraps(call)
    async def run(*args: Any, **kwargs: Any) -> T:
        with _cluster_errors():
            return await call(*args, **kwargs)

    return run


def stream_read_keys(args: tuple[Any, ...]) -> list[Any] | None:
    """The stream keys of an XREAD or XREADGROUP's arguments (its name left out): the first
    half of what follows ``STREAMS``; None when there is no ``STREAMS``.

    redis-py finds these keys by asking a node (``COMMAND GETKEYS``, since the two commands'
    keys move): one more round trip on every read, to a node chosen once at start, so while
    that node fails over the read fails with an error from inside redis-py (not a Redis
    error). Reading them here costs neither."""
    for index, arg in enumerate(args):
        token = arg.decode() if isinstance(arg, bytes) else arg
        if isinstance(token, str) and token.upper() == "STREAMS":
            rest = args[index + 1 :]
            return list(rest[: len(rest) // 2]) or None
    return None


_STREAM_READS = frozenset({"XREAD", "XREADGROUP"})


def _same_slot(cluster: RedisCluster | AsyncRedisCluster, keys: list[Any]) -> int | None:
    """The slot of ``keys`` when they share one; None leaves the choice to redis-py."""
    slots = {cluster.keyslot(key) for key in keys}
    return slots.pop() if len(slots) == 1 else None


class _Cluster(RedisCluster):
    def determine_slot(self, *args: Any) -> int | None:
        keys = stream_read_keys(args[1:]) if str(args[0]).upper() in _STREAM_READS else None
        slot = _same_slot(self, keys) if keys else None
        if slot is not None:
            return slot
        return super().determine_slot(*args)

    def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        with _cluster_errors():
            return super().execute_command(*args, **kwargs)  # type: ignore[no-untyped-call]

    def pipeline(self, transaction: Any = None, shard_hint: Any = None) -> Any:
        pipe = super().pipeline(transaction, shard_hint)  # type: ignore[no-untyped-call]
        setattr(pipe, "execute", _translated(pipe.execute))  # noqa: B010 (on this instance)
        return pipe


class _AsyncCluster(AsyncRedisCluster):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Commands written at once (sluice.core.redis_client.prompt), on the nodes known now and
        # those found later (made with these arguments).
        options = self.connection_kwargs
        options["connection_class"] = prompt_class(options.get("connection_class"))
        for node in self.nodes_manager.startup_nodes.values():
            node.connection_class = prompt_class(node.connection_class)

    async def _determine_slot(self, command: str, *args: Any) -> int:
        keys = stream_read_keys(args) if command.upper() in _STREAM_READS else None
        slot = _same_slot(self, keys) if keys else None
        if slot is not None:
            return slot
        return await super()._determine_slot(command, *args)

    async def initialize(self, *args: Any, **kwargs: Any) -> AsyncRedisCluster:
        """(reads the cluster's layout: at the first command, and again after a failover)"""
        with _cluster_errors():
            return await super().initialize(*args, **kwargs)

    async def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        with _cluster_errors():
            return await super().execute_command(*args, **kwargs)

    def pipeline(self, transaction: Any = None, shard_hint: Any = None) -> Any:
        pipe = super().pipeline(transaction, shard_hint)
        setattr(pipe, "execute", _translated_async(pipe.execute))  # noqa: B010 (on this instance)
        return pipe


_CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}


def split_url(url: str) -> tuple[str, bool]:
    """(the URL redis-py understands, whether it names a cluster)."""
    scheme, sep, rest = url.partition("://")
    plain = _CLUSTER_SCHEMES.get(scheme.lower())
    if sep and plain is not None:
        return f"{plain}://{rest}", True
    return url, False


def is_cluster_url(url: str) -> bool:
    return split_url(url)[1]


def _cluster_options(options: dict[str, Any]) -> dict[str, Any]:
    """Cluster clients take no ``db``, and keep their own retry policy (with backoff), which
    follows slot moves and a failover; a plain client's single quick retry would not."""
    return {k: v for k, v in options.items() if k not in ("db", "retry")}


def connect(url: str, **options: Any) -> Redis:
    """A synchronous client for ``url``."""
    plain, cluster = split_url(url)
    if not cluster:
        return Redis.from_url(plain, **options)
    with _cluster_errors():  # (the synchronous client reads the cluster's layout at once)
        client = _Cluster.from_url(_without_db(plain), **_cluster_options(options))
    return cast(Redis, client)


def connect_async(url: str, **options: Any) -> AsyncRedis:
    """An asyncio client for ``url``."""
    plain, cluster = split_url(url)
    if not cluster:
        return AsyncRedis.from_url(plain, connection_class=prompt_class_for(plain), **options)
    client = _AsyncCluster.from_url(_without_db(plain), **_cluster_options(options))
    return cast(AsyncRedis, client)


def _without_db(url: str) -> str:
    """A cluster has only database 0: a ``/0`` path is dropped, another one refused."""
    head, sep, path = url.partition("://")
    host, slash, db = path.partition("/")
    db, _, query = db.partition("?")
    if slash and db not in ("", "0"):
        raise ValueError(f"a Redis Cluster has only database 0, not '{db}' ({url})")
    return f"{head}{sep}{host}" + (f"?{query}" if query else "")


async def server_identity(redis: AsyncRedis) -> str:
    """What changes when Redis loses its data: the server's run id, or on a cluster the
    run ids of all its primaries (a failover replaces one, and writes it had not yet passed
    to its replica may be gone with it)."""
    if isinstance(redis, AsyncRedisCluster):
        found = await redis.info("server", target_nodes=AsyncRedisCluster.PRIMARIES)
        return ",".join(sorted(str(info.get("run_id", "")) for info in found.values()))
    server = await redis.info("server")
    return str(server.get("run_id", ""))
