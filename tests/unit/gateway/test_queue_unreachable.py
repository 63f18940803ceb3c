"""Redis out of reach: one text for the client over HTTP and gRPC, and never the Redis
client's error, which names the server's internal address."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import grpc
import orjson
from redis.exceptions import ConnectionError as RedisConnectionError

from sluice.core.errors import QUEUE_UNREACHABLE
from sluice.gateway.grpc_api.status import status_of
from sluice.gateway.http.errors import _redis_error

ERROR = RedisConnectionError("Error 111 connecting to 10.1.2.3:6379. Connection refused.")


def test_http_answers_503_without_the_address() -> None:
    response = asyncio.run(_redis_error(cast(Any, None), ERROR))
    assert response.status_code == 503
    assert orjson.loads(bytes(response.body)) == {"error": QUEUE_UNREACHABLE}


def test_grpc_answers_unavailable_without_the_address() -> None:
    assert status_of(ERROR) == (grpc.StatusCode.UNAVAILABLE, QUEUE_UNREACHABLE)
