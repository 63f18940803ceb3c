"""A real gateway process with two tenants' admin keys, over a real redis-server: the host's
bound on client shared memory regions (SLUICE_MAX_SHM_REGIONS) is shared by every tenant,
so each tenant also has its own (SLUICE_TENANT_MAX_SHM_REGIONS); and the records of regions
written before regions belonged to tenants no longer hold places of the host for good.

Before: team-a could register every region the host allows and every other tenant got 429;
and records of no tenant, invisible to all, counted against the host's bound forever.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from typing import cast

import httpx
import pytest
import tritonclient.grpc as grpcclient
from redis import Redis
from tritonclient.utils import InferenceServerException

from sluice.core.keys import Keys
from sluice.core.shm import SHM_DIR
from sluice.scheduler.executor.redis_server import RedisServer, free_port
from tests.support.procs import wait_until

HOST_REGIONS = 3
TENANT_REGIONS = 2
HOST = "shm-bounds-host"
KEYS = {"team-a": "key-a", "team-b": "key-b"}
LEGACY = b'{"key": "/gone", "offset": 0, "byte_size": 8}'


def _live(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/v2/health/live", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def _fields(redis: Redis, key: str) -> list[bytes]:
    return sorted(cast(list[bytes], redis.hkeys(key)))


@pytest.fixture
def shm_key() -> Iterator[str]:
    name = f"shmtest-bounds-{uuid.uuid4().hex[:12]}"
    path = SHM_DIR / name
    path.write_bytes(b"\0" * 4096)
    yield "/" + name
    path.unlink(missing_ok=True)


def _gateway(redis_url: str, namespace: str, port: int, grpc_port: int) -> subprocess.Popen[bytes]:
    env = dict(
        os.environ,
        SLUICE_REDIS_URL=redis_url,
        SLUICE_NAMESPACE=namespace,
        SLUICE_HTTP_PORT=str(port),
        SLUICE_GRPC_PORT=str(grpc_port),
        SLUICE_HOST_ID=HOST,
        SLUICE_ADMIN_KEYS=",".join(f"{tenant}:{key}" for tenant, key in KEYS.items()),
        SLUICE_MAX_SHM_REGIONS=str(HOST_REGIONS),
        SLUICE_TENANT_MAX_SHM_REGIONS=str(TENANT_REGIONS),
    )
    return subprocess.Popen(
        [sys.executable, "-m", "sluice.gateway"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def test_each_tenant_has_its_own_bound_and_records_of_no_tenant_go(
    redis_server: RedisServer, shm_key: str
) -> None:
    namespace, port, grpc_port = f"t{uuid.uuid4().hex[:8]}", free_port(), free_port()
    keys = Keys(namespace)
    system = keys.client_regions(HOST, "system")
    redis = Redis.from_url(redis_server.url)
    # Records an earlier version left: as many as the host allows, of no tenant.
    redis.hset(system, mapping={f"old{i}": LEGACY for i in range(HOST_REGIONS)})
    redis.incr(keys.client_regions_revision(HOST))
    gateway = _gateway(redis_server.url, namespace, port, grpc_port)
    try:
        assert wait_until(lambda: _live(port), 60, 0.2), "the gateway did not start"
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as http:

            def register(tenant: str, name: str) -> httpx.Response:
                return http.post(
                    f"/v2/systemsharedmemory/region/{name}/register",
                    json={"key": shm_key, "offset": 0, "byte_size": 64},
                    headers={"Authorization": f"Bearer {KEYS[tenant]}"},
                )

            for name in ("a1", "a2"):
                answer = register("team-a", name)
                assert answer.status_code == 200, answer.text
            assert not any(field.startswith(b"old") for field in _fields(redis, system))

            over = register("team-a", "a3")
            assert over.status_code == 429, over.text
            assert over.json()["error"] == (
                "failed to register shared memory region 'a3': tenant 'team-a' has 2 regions "
                "registered on this host already, the most SLUICE_TENANT_MAX_SHM_REGIONS "
                "allows; unregister one first"
            )
            assert "Retry-After" in over.headers

            # team-b still gets what the host has left...
            answer = register("team-b", "b1")
            assert answer.status_code == 200, answer.text
            # ...and the host's own bound still holds.
            full = register("team-b", "b2")
            assert full.status_code == 429, full.text
            assert "SLUICE_MAX_SHM_REGIONS allows" in full.json()["error"]

            with grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}") as rpc:
                with pytest.raises(InferenceServerException) as refused:
                    rpc.register_system_shared_memory(
                        "a3", shm_key, 64, headers={"authorization": "Bearer key-a"}
                    )
                assert "RESOURCE_EXHAUSTED" in str(refused.value.status())
                assert "SLUICE_TENANT_MAX_SHM_REGIONS" in str(refused.value.message())

            mine = http.get(
                "/v2/systemsharedmemory/status", headers={"Authorization": "Bearer key-a"}
            )
            assert [row["name"] for row in mine.json()] == ["a1", "a2"]
        assert _fields(redis, system) == [b"team-a/a1", b"team-a/a2", b"team-b/b1"]
    finally:
        if gateway.poll() is None:
            gateway.terminate()
            try:
                gateway.wait(20)
            except subprocess.TimeoutExpired:
                gateway.kill()
                gateway.wait(10)
        redis.delete(system)
        redis.close()
