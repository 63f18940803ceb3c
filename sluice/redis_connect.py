"""Redis clients from ``SLUICE_REDIS_URL``: one Redis, or a Redis Cluster.

``redis://host:port/db`` (``rediss://`` with TLS) is one server; ``redis+cluster://host:port``
(``rediss+cluster://``) is any node of a Redis Cluster, and redis-py's cluster client finds
the others, follows slot moves and fails over with the cluster. Both clients answer the same
commands; what differs is that a multi-key command, script or transaction must stay within
one hash slot, which the key layout (:mod:`sluice.keys`) ensures.

The rest of Sluice types the cluster client as the plain one: it is used only through the
commands both share.
"""

from __future__ import annotations

from typing import Any, cast

from redis import Redis
from redis.asyncio import Redis as AsyncRedis

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
    from redis.cluster import RedisCluster

    client = RedisCluster.from_url(_without_db(plain), **_cluster_options(options))
    return cast(Redis, client)


def connect_async(url: str, **options: Any) -> AsyncRedis:
    """An asyncio client for ``url``."""
    plain, cluster = split_url(url)
    if not cluster:
        return AsyncRedis.from_url(plain, **options)
    from redis.asyncio.cluster import RedisCluster

    client = RedisCluster.from_url(_without_db(plain), **_cluster_options(options))
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
    from redis.asyncio.cluster import RedisCluster

    if isinstance(redis, RedisCluster):
        found = await redis.info("server", target_nodes=RedisCluster.PRIMARIES)
        return ",".join(sorted(str(info.get("run_id", "")) for info in found.values()))
    server = await redis.info("server")
    return str(server.get("run_id", ""))
