"""Uploads expire without any batch worker: the gateway's own store sweeper removes an
upload past ``SLUICE_UPLOAD_RETENTION_S``, its file and its record, and gives its bytes
back to the tenant."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import httpx

from sluice.core.keys import Keys
from sluice.core.redis_client.connect import connect
from sluice.scheduler.executor.redis_server import RedisServer
from tests.support.procs import wait_until
from tests.support.stack import Stack

EXAMPLES = Path(__file__).resolve().parents[2] / "model_repository"


def test_an_upload_expires_with_no_batch_worker_running(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    repository = tmp_path / "repository"
    shutil.copytree(EXAMPLES / "mlp", repository / "mlp")
    store = tmp_path / "store"
    env = {
        "SLUICE_API_KEYS": "team-a:key-a",
        "SLUICE_BATCH_STORE": str(store),
        "SLUICE_BATCH_WORKERS": "0",
        "SLUICE_UPLOAD_RETENTION_S": "2",
        "SLUICE_STORE_SWEEP_S": "0.5",
    }
    stack = Stack(repository, redis_server.url, grpc_port=0, env=env)
    stack.start()
    client = connect(stack.redis_url or "", socket_timeout=5)
    try:
        data = b'{"x": [1.0]}\n' * 100
        headers = {
            "Authorization": "Bearer key-a",
            "Sluice-Content-SHA256": hashlib.sha256(data).hexdigest(),
        }
        with httpx.Client(base_url=stack.url, headers=headers, timeout=30) as http:
            answer = http.post("/v2/uploads?name=rows.jsonl", content=data)
            assert answer.status_code == 201, answer.text
            upload_id = answer.json()["id"]
            assert http.get(f"/v2/uploads/{upload_id}").status_code == 200
            stored = Keys(stack.namespace).stored_bytes("team-a")
            assert int(client.get(stored) or 0) == len(data)

            def gone() -> bool:
                return http.get(f"/v2/uploads/{upload_id}").status_code == 404

            assert wait_until(gone, 60), "the upload did not expire"
        assert int(client.get(stored) or 0) == 0
        assert not [p for p in (store / "team-a" / "uploads").rglob("*") if p.is_file()]
    finally:
        client.close()
        stack.stop()
