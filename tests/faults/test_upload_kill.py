"""A gateway killed (SIGKILL) in the middle of an upload: no handler of its runs, so what
the upload had counted against its tenant's stored bytes, and the partial file it was
writing into the batch store, used to stay for good. The upload's record says what it
holds from its first byte, and the store sweepers give it back and remove the file once
the upload has been silent for a while."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx

from sluice.core.batch_jobs.store import open_store
from sluice.core.batch_jobs.sweeper import StoreSweeper
from sluice.core.batch_jobs.uploads import PARTIAL_UPLOAD_GRACE_S
from sluice.core.keys import Keys
from sluice.core.redis_client.connect import connect
from sluice.core.settings import BatchSettings
from sluice.scheduler.executor.redis_server import RedisServer, free_port
from tests.support.procs import wait_until

KEY = "key-a"
TENANT = "team-a"


def _gateway(redis_url: str, namespace: str, store: Path, port: int) -> subprocess.Popen[bytes]:
    env = dict(
        os.environ,
        SLUICE_REDIS_URL=redis_url,
        SLUICE_NAMESPACE=namespace,
        SLUICE_HTTP_PORT=str(port),
        SLUICE_GRPC_PORT="0",
        SLUICE_API_KEYS=f"{TENANT}:{KEY}",
        SLUICE_BATCH_STORE=str(store),
    )
    return subprocess.Popen(
        [sys.executable, "-m", "sluice.gateway"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def _live(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/v2/health/live", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def _files(folder: Path) -> list[Path]:
    return [p for p in folder.rglob("*") if p.is_file()] if folder.exists() else []


def test_an_upload_cut_by_a_killed_gateway_gives_its_bytes_and_file_back(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    namespace, port, store = f"t{uuid.uuid4().hex[:8]}", free_port(), tmp_path / "store"
    keys = Keys(namespace)
    redis = connect(redis_server.url, socket_timeout=5)
    gateway = _gateway(redis_server.url, namespace, store, port)
    try:
        assert wait_until(lambda: _live(port), 60, 0.2), "the gateway did not start"
        sent = 3 << 20
        with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
            raw.sendall(
                (
                    "POST /v2/uploads?name=rows.npy HTTP/1.1\r\nHost: x\r\n"
                    f"Authorization: Bearer {KEY}\r\nContent-Length: {8 << 20}\r\n\r\n"
                ).encode()
            )
            for _ in range(sent >> 16):
                raw.sendall(b"\0" * 65_536)
            assert wait_until(
                lambda: int(redis.get(keys.stored_bytes(TENANT)) or 0) >= 2 << 20, 30
            ), "the upload's bytes were never counted"
            gateway.send_signal(signal.SIGKILL)
            gateway.wait(10)
        counted = int(redis.get(keys.stored_bytes(TENANT)) or 0)
        assert counted > 0 and _files(store / TENANT / "uploads"), "nothing to give back"

        sweeper = StoreSweeper(redis, keys, open_store(BatchSettings(batch_store=str(store))))
        sweeper.sweep(time.time() + 1)  # the upload was under way a moment ago: kept
        assert int(redis.get(keys.stored_bytes(TENANT)) or 0) == counted
        sweeper.sweep(time.time() + PARTIAL_UPLOAD_GRACE_S + 1)
        assert int(redis.get(keys.stored_bytes(TENANT)) or 0) == 0
        assert _files(store / TENANT / "uploads") == []
        assert redis.zcard(keys.uploads(TENANT)) == 0
        assert redis.zcard(keys.store_expiry) == 0
    finally:
        if gateway.poll() is None:
            gateway.kill()
            gateway.wait(10)
        redis.close()
