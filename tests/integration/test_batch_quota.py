"""A tenant's batch outputs in the deployment's batch store count against its stored-bytes
quota, as its uploads do, over real HTTP with a real batch worker (``sluice up``):

- a job whose next part would pass the quota stops with the limit named in its status, and
  the parts of the shards it committed stay readable (their rows listed, each downloadable);
- at the quota, a new job and a resume are refused with 429 naming the limit;
- a job that ended can be deleted (409 while it runs), and its outputs go with it, their
  bytes given back, as do those of the upload it no longer holds;
- ``sluice batch download`` of a failed or cancelled job fetches the parts it committed,
  says so and exits 1, and ``sluice batch delete`` deletes a job that ended (a running one,
  an unknown one or another tenant's each told why, exit 1).

It used to be that each shard past the quota failed on its own after computing its rows,
a job that did not complete showed none of what it had answered (409), and a tenant could
free its room only by waiting a week for its jobs to expire; the command line could not
delete a job, and its download of a job that did not complete fetched what it had
committed as if it had, exit 0."""

from __future__ import annotations

import hashlib
import io
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import onnxruntime as ort
import pytest
from redis import Redis

from sluice.core.keys import Keys
from sluice.core.redis_client.connect import connect
from sluice.scheduler.executor.redis_server import RedisServer
from tests.support.gate_model import BLOCKER_ITERS, open_gate, write_gate
from tests.support.procs import wait_until
from tests.support.stack import Stack

EXAMPLES = Path(__file__).resolve().parents[2] / "model_repository"
TENANT, KEY = "team-q", "key-q"
OTHER_KEY = "key-r"
ROWS, SHARD_ROWS = 10_000, 1_000
UPLOAD_BYTES = 128 + ROWS * 16 * 4
PART_BYTES = 128 + SHARD_ROWS * 4 * 4
"""A part of mlp's outputs (4 FP32 values a row) for one shard, as ``.npy``."""
ROOM = 3 * PART_BYTES + PART_BYTES // 2
QUOTA = UPLOAD_BYTES + ROOM
"""Room for the upload and three parts and a half of the ten."""
FINISHED = ("completed", "failed", "cancelled")


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("quota-store")


@pytest.fixture(scope="module")
def stack(
    tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer, store: Path
) -> Iterator[Stack]:
    repository = tmp_path_factory.mktemp("quota-models")
    shutil.copytree(EXAMPLES / "mlp", repository / "mlp")
    write_gate(repository, "gate")  # (holds a job running until its gate opens)
    gate = tmp_path_factory.mktemp("quota-gate")
    env = {
        "SLUICE_API_KEYS": f"{TENANT}:{KEY},team-r:{OTHER_KEY}",
        "SLUICE_TEST_GATE": str(gate),
        "SLUICE_BATCH_STORE": str(store),
        "SLUICE_BATCH_WORKERS": "1",
        "SLUICE_TENANT_MAX_STORED_BYTES": str(QUOTA),
    }
    stack = Stack(repository, redis_server.url, env=env)
    stack.start()
    yield stack
    stack.stop()


@pytest.fixture
def client(stack: Stack) -> Iterator[httpx.Client]:
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=stack.url, headers=headers, timeout=30) as made:
        yield made


@pytest.fixture
def redis(stack: Stack) -> Iterator[Redis]:
    made = connect(stack.redis_url or "", socket_timeout=5)
    yield made
    made.close()


def npy(rows: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, rows)
    return buffer.getvalue()


def upload(client: httpx.Client, data: bytes, name: str) -> str:
    digest = hashlib.sha256(data).hexdigest()
    answer = client.post(
        f"/v2/uploads?name={name}", content=data, headers={"Sluice-Content-SHA256": digest}
    )
    assert answer.status_code == 201, answer.text
    upload_id: str = answer.json()["id"]
    return upload_id


def wait_finished(client: httpx.Client, batch_id: str) -> dict[str, Any]:
    assert wait_until(
        lambda: client.get(f"/v2/batches/{batch_id}").json()["status"] in FINISHED, 120, 0.2
    )
    state: dict[str, Any] = client.get(f"/v2/batches/{batch_id}").json()
    return state


def in_process(rows: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(str(EXAMPLES / "mlp" / "1" / "model.onnx"))
    answered: np.ndarray = session.run(None, {session.get_inputs()[0].name: rows})[0]
    return answered


def refused_for_quota(answer: httpx.Response) -> bool:
    return (
        answer.status_code == 429
        and f"SLUICE_TENANT_MAX_STORED_BYTES ({QUOTA})" in answer.json()["error"]
        and int(answer.headers["retry-after"]) > 0
    )


def test_outputs_count_against_the_quota_and_go_back_when_deleted(
    client: httpx.Client, redis: Redis, stack: Stack, store: Path
) -> None:
    keys = Keys(stack.namespace)

    def stored() -> int:
        return int(redis.get(keys.stored_bytes(TENANT)) or 0)

    rows = np.random.default_rng(7).standard_normal((ROWS, 16), dtype=np.float32)
    upload_id = upload(client, npy(rows), "rows.npy")
    job = {"model": "mlp", "input": f"upload:{upload_id}", "options": {"shard_rows": SHARD_ROWS}}
    submitted = client.post("/v2/batches", json=job)
    assert submitted.status_code == 201, submitted.text
    batch_id = submitted.json()["id"]

    # It stops at the quota, saying so; what it committed stays readable.
    state = wait_finished(client, batch_id)
    assert state["status"] == "failed", state
    assert f"SLUICE_TENANT_MAX_STORED_BYTES ({QUOTA})" in state["error"]
    assert state["shards"]["done"] == 3, state
    listed = client.get(f"/v2/batches/{batch_id}/outputs")
    assert listed.status_code == 200, listed.text
    parts = listed.json()["files"]
    assert len(parts) == 3 and all(part["bytes"] == PART_BYTES for part in parts)
    for part in parts:
        start, end = part["rows"]
        download = client.get(f"/v2/batches/{batch_id}/outputs/{part['name']}")
        assert download.status_code == 200
        answered = np.load(io.BytesIO(download.content), allow_pickle=False)
        np.testing.assert_allclose(answered, in_process(rows[start:end]), rtol=1e-5, atol=1e-5)
    assert stored() == UPLOAD_BYTES + 3 * PART_BYTES <= QUOTA

    # At the quota: no new job, no resume.
    filler = upload(client, b"\0" * (QUOTA - stored()), "filler.npy")
    assert stored() == QUOTA
    assert refused_for_quota(client.post("/v2/batches", json=job))
    assert refused_for_quota(client.post(f"/v2/batches/{batch_id}/resume"))

    # With room again it resumes (and cannot be deleted while it runs); it stops again at
    # the quota, its three parts still there.
    assert client.delete(f"/v2/uploads/{filler}").status_code == 204
    resumed = client.post(f"/v2/batches/{batch_id}/resume")
    assert resumed.status_code == 200 and resumed.json()["status"] == "running", resumed.text
    running = client.delete(f"/v2/batches/{batch_id}")
    assert running.status_code == 409 and "cancel it first" in running.json()["error"]
    state = wait_finished(client, batch_id)
    assert state["status"] == "failed" and state["shards"]["done"] == 3, state
    assert client.get(f"/v2/batches/{batch_id}/outputs").json()["files"] == parts
    assert stored() == UPLOAD_BYTES + 3 * PART_BYTES

    # Deleted: its outputs go, their bytes go back, and its upload is free to go too.
    assert client.delete(f"/v2/batches/{batch_id}").status_code == 204
    assert client.get(f"/v2/batches/{batch_id}").status_code == 404
    assert client.delete(f"/v2/batches/{batch_id}").status_code == 404
    assert batch_id not in [x["id"] for x in client.get("/v2/batches").json()["batches"]]
    assert not (store / TENANT / "batches" / batch_id).exists()
    assert stored() == UPLOAD_BYTES
    assert client.delete(f"/v2/uploads/{upload_id}").status_code == 204
    assert stored() == 0
    assert not redis.hlen(keys.batch_stored(TENANT))


def sluice_batch(
    folder: Path, stack: Stack, *args: str, key: str = KEY
) -> subprocess.CompletedProcess[str]:
    """``sluice batch ARGS`` in ``folder``, with the tenant's key (``SLUICE_API_KEY``)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLUICE_")}
    env.update(SLUICE_URL=stack.url, SLUICE_API_KEY=key)
    return subprocess.run(
        [sys.executable, "-m", "sluice.cli", "batch", *args],
        cwd=folder,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_cli_downloads_what_a_failed_job_committed_and_deletes_it(
    client: httpx.Client, stack: Stack, store: Path, tmp_path: Path
) -> None:
    rows = np.random.default_rng(8).standard_normal((ROWS, 16), dtype=np.float32)
    upload_id = upload(client, npy(rows), "rows.npy")
    job = {"model": "mlp", "input": f"upload:{upload_id}", "options": {"shard_rows": SHARD_ROWS}}
    batch_id = client.post("/v2/batches", json=job).json()["id"]
    state = wait_finished(client, batch_id)
    assert state["status"] == "failed" and state["shards"]["done"] == 3, state
    listed = client.get(f"/v2/batches/{batch_id}/outputs").json()["files"]

    fetched = sluice_batch(tmp_path, stack, "download", batch_id, "--output", "parts")
    assert fetched.returncode == 1, fetched.stderr
    assert "failed" in fetched.stdout and "SLUICE_TENANT_MAX_STORED_BYTES" in fetched.stdout
    assert f"downloaded 3 files ({3 * PART_BYTES:,} bytes)" in fetched.stdout, fetched.stdout
    assert "only the parts of the shards it committed were downloaded" in fetched.stdout
    assert sorted(path.name for path in (tmp_path / "parts").iterdir()) == sorted(
        part["name"] for part in listed
    )
    for part in listed:
        start, end = part["rows"]
        answered = np.load(tmp_path / "parts" / part["name"], allow_pickle=False)
        np.testing.assert_allclose(answered, in_process(rows[start:end]), rtol=1e-5, atol=1e-5)

    # Another tenant's job is unknown to it; its own tenant deletes it, once.
    foreign = sluice_batch(tmp_path, stack, "delete", batch_id, key=OTHER_KEY)
    assert foreign.returncode == 1 and f"no batch '{batch_id}'" in foreign.stderr
    assert "not this API key's tenant's" in foreign.stderr
    assert client.get(f"/v2/batches/{batch_id}").status_code == 200
    deleted = sluice_batch(tmp_path, stack, "delete", batch_id)
    assert deleted.returncode == 0, deleted.stderr
    assert f"batch {batch_id} deleted" in deleted.stdout
    assert client.get(f"/v2/batches/{batch_id}").status_code == 404
    assert not (store / TENANT / "batches" / batch_id).exists()
    again = sluice_batch(tmp_path, stack, "delete", batch_id)
    assert again.returncode == 1 and "deleted already" in again.stderr
    assert "Traceback" not in foreign.stderr + again.stderr
    assert client.delete(f"/v2/uploads/{upload_id}").status_code == 204


def test_the_cli_refuses_to_delete_a_running_job_and_fetches_nothing_of_a_cancelled_one(
    client: httpx.Client, stack: Stack, tmp_path: Path
) -> None:
    archive = io.BytesIO()
    np.savez(archive, IN=np.ones((2, 4), dtype=np.float32), ITERS=np.full((2, 1), BLOCKER_ITERS))
    upload_id = upload(client, archive.getvalue(), "held.npz")
    submitted = client.post("/v2/batches", json={"model": "gate", "input": f"upload:{upload_id}"})
    assert submitted.status_code == 201, submitted.text
    batch_id = submitted.json()["id"]
    try:
        assert wait_until(
            lambda: client.get(f"/v2/batches/{batch_id}").json()["status"] == "running", 60, 0.1
        )
        running = sluice_batch(tmp_path, stack, "delete", batch_id)
        assert running.returncode == 1, running.stdout
        assert "is running: cancel it first" in running.stderr
        assert f"sluice batch cancel {batch_id}" in running.stderr
        assert client.get(f"/v2/batches/{batch_id}").json()["status"] == "running"
        cancelled = client.post(f"/v2/batches/{batch_id}/cancel")
        assert cancelled.json()["status"] == "cancelled", cancelled.text
    finally:
        open_gate(Path(stack.env["SLUICE_TEST_GATE"]), "gate")
    fetched = sluice_batch(tmp_path, stack, "download", batch_id, "--output", "none")
    assert fetched.returncode == 1, fetched.stderr
    assert "downloaded 0 files" in fetched.stdout
    assert f"batch {batch_id} was cancelled: only the parts" in fetched.stdout
    deleted = sluice_batch(tmp_path, stack, "delete", batch_id)
    assert deleted.returncode == 0, deleted.stderr
    assert client.get(f"/v2/batches/{batch_id}").status_code == 404
    assert client.delete(f"/v2/uploads/{upload_id}").status_code == 204
