"""Batch data through the gateway, per tenant, in the deployment's batch store: two tenants
over real HTTP walk every upload and batch route (B cannot see, change or learn of A's; a
wrong key or none is 401); uploads are streamed, checked and leave nothing behind when they
fail; the stored-bytes quota; B's many batches do not hide A's; and everything expires
with its files (the store sweeper of the batch workers and gateways, run here at a later
time)."""

from __future__ import annotations

import hashlib
import io
import json
import shutil
import socket
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import onnxruntime as ort
import pytest
from redis import Redis

from sluice.core.batch_jobs.store import open_store
from sluice.core.batch_jobs.sweeper import StoreSweeper
from sluice.core.keys import Keys
from sluice.core.redis_client.connect import connect
from sluice.core.settings import BatchSettings
from sluice.scheduler.executor.redis_server import RedisServer
from tests.support.procs import wait_until
from tests.support.stack import Stack

EXAMPLES = Path(__file__).resolve().parents[2] / "model_repository"
KEYS = {"a": "key-a", "b": "key-b", "c": "key-c"}
MAX_UPLOAD = 2 << 20
QUOTA = 3 << 20
FINISHED = ("completed", "failed", "cancelled")


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("batch-store")


@pytest.fixture(scope="module")
def stack(
    tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer, store: Path
) -> Iterator[Stack]:
    repository = tmp_path_factory.mktemp("tenant-models")
    shutil.copytree(EXAMPLES / "mlp", repository / "mlp")
    env = {
        "SLUICE_API_KEYS": ",".join(f"team-{t}:{k}" for t, k in KEYS.items()),
        "SLUICE_ADMIN_KEYS": "admin-key",
        "SLUICE_BATCH_STORE": str(store),
        "SLUICE_BATCH_WORKERS": "1",
        "SLUICE_MAX_UPLOAD_BYTES": str(MAX_UPLOAD),
        "SLUICE_TENANT_MAX_STORED_BYTES": str(QUOTA),
    }
    stack = Stack(repository, redis_server.url, env=env)
    stack.start()
    yield stack
    stack.stop()


_OPEN: list[httpx.Client] = []


@pytest.fixture(autouse=True)
def _close_clients() -> Iterator[None]:
    yield
    while _OPEN:
        _OPEN.pop().close()


def http(stack: Stack, tenant: str | None, key: str | None = None) -> httpx.Client:
    """A client of ``tenant`` (None: no key at all; ``key``: that key instead), closed
    after the test."""
    headers = {}
    if tenant is not None or key is not None:
        headers["Authorization"] = f"Bearer {key or KEYS[tenant or '']}"
    client = httpx.Client(base_url=stack.url, headers=headers, timeout=30)
    _OPEN.append(client)
    return client


@pytest.fixture
def redis(stack: Stack) -> Iterator[Redis]:
    client = connect(stack.redis_url or "", socket_timeout=5)
    yield client
    client.close()


def npy(rows: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, rows)
    return buffer.getvalue()


def in_process(rows: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(str(EXAMPLES / "mlp" / "1" / "model.onnx"))
    return session.run(None, {session.get_inputs()[0].name: rows})[0]


def upload(client: httpx.Client, data: bytes, name: str = "rows.npy") -> dict[str, Any]:
    digest = hashlib.sha256(data).hexdigest()
    answer = client.post(
        f"/v2/uploads?name={name}", content=data, headers={"Sluice-Content-SHA256": digest}
    )
    assert answer.status_code == 201, answer.text
    return answer.json()


def wait_finished(client: httpx.Client, batch_id: str, timeout_s: float = 120) -> dict[str, Any]:
    assert wait_until(
        lambda: client.get(f"/v2/batches/{batch_id}").json()["status"] in FINISHED, timeout_s, 0.2
    )
    state: dict[str, Any] = client.get(f"/v2/batches/{batch_id}").json()
    return state


def stored_files(store: Path, tenant: str, area: str) -> list[Path]:
    folder = store / tenant / area
    return sorted(p for p in folder.rglob("*") if p.is_file()) if folder.exists() else []


def same_as_unknown(answer: httpx.Response, known: str, unknown: str, probe: str) -> None:
    """``answer`` (about ``known``) reads exactly as ``probe`` (about ``unknown``) did."""
    assert answer.status_code == 404, answer.text
    assert answer.json()["error"].replace(known, "<id>") == probe.replace(unknown, "<id>")


def test_two_tenants_walk_every_upload_and_batch_route(stack: Stack, store: Path) -> None:
    a, b = http(stack, "a"), http(stack, "b")
    rows = np.random.default_rng(1).standard_normal((2_000, 16), dtype=np.float32)
    data = npy(rows)
    made = upload(a, data)
    assert made["name"] == "rows.npy" and made["bytes"] == len(data)
    assert made["sha256"] == hashlib.sha256(data).hexdigest() and len(made["id"]) == 32
    assert made["expires"] > time.time() + 3600
    upload_id = made["id"]
    assert [u["id"] for u in a.get("/v2/uploads").json()["uploads"]] == [upload_id]
    assert a.get(f"/v2/uploads/{upload_id}").json()["bytes"] == len(data)

    submitted = a.post("/v2/batches", json={"model": "mlp", "input": f"upload:{upload_id}"})
    assert submitted.status_code == 201, submitted.text
    batch_id = submitted.json()["id"]
    assert submitted.headers["location"] == f"/v2/batches/{batch_id}"
    assert submitted.json()["output"] is None
    state = wait_finished(a, batch_id)
    assert state["status"] == "completed", state
    assert state["manifest"] == f"/v2/batches/{batch_id}/outputs/_manifest.json"
    listing = a.get("/v2/batches").json()["batches"]
    assert [x["id"] for x in listing] == [batch_id]
    assert str(store) not in json.dumps(state) + json.dumps(listing)

    files = a.get(f"/v2/batches/{batch_id}/outputs").json()["files"]
    names = {f["name"]: f["bytes"] for f in files}
    assert {"_manifest.json", "output.npy", "part-000000-a1.output.npy"} <= set(names)
    download = a.get(f"/v2/batches/{batch_id}/outputs/output.npy")
    assert download.status_code == 200
    assert download.headers["content-type"] == "application/octet-stream"
    assert int(download.headers["content-length"]) == names["output.npy"] == len(download.content)
    output = np.load(io.BytesIO(download.content), allow_pickle=False)
    np.testing.assert_allclose(output, in_process(rows), rtol=1e-5, atol=1e-5)
    manifest = a.get(f"/v2/batches/{batch_id}/outputs/_manifest.json").json()
    assert manifest["input"] == f"upload:{upload_id}" and manifest["outputs"] == {
        "output": "output.npy"
    }
    for name in ("../../etc/passwd", "..%2F_manifest.json", "nope.npy"):
        assert a.get(f"/v2/batches/{batch_id}/outputs/{name}").status_code == 404

    # Cancel and resume walk (cancelled before a worker plans it, then resumed to the end).
    second = a.post("/v2/batches", json={"model": "mlp", "input": f"upload:{upload_id}"}).json()
    cancelled = a.post(f"/v2/batches/{second['id']}/cancel")
    assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
    outputs = a.get(f"/v2/batches/{second['id']}/outputs")
    assert outputs.status_code == 200 and outputs.json() == {"files": []}  # none committed
    assert a.post(f"/v2/batches/{second['id']}/resume").status_code == 200
    assert wait_finished(a, second["id"])["status"] == "completed"
    assert a.post(f"/v2/batches/{batch_id}/resume").status_code == 400  # complete already
    deleted = a.delete(f"/v2/uploads/{upload_id}")
    assert deleted.status_code == 409 and "batch job" in deleted.json()["error"]

    # B: A's upload and batch are unknown to it, word for word; B's listings are empty.
    unknown = uuid.uuid4().hex
    probe = b.get(f"/v2/uploads/{unknown}").json()["error"]
    same_as_unknown(b.get(f"/v2/uploads/{upload_id}"), upload_id, unknown, probe)
    same_as_unknown(b.delete(f"/v2/uploads/{upload_id}"), upload_id, unknown, probe)
    refused = b.post("/v2/batches", json={"model": "mlp", "input": f"upload:{upload_id}"})
    same_as_unknown(refused, upload_id, unknown, probe)
    probe = b.get(f"/v2/batches/{unknown}").json()["error"]
    for method, path in (
        ("GET", ""),
        ("POST", "/cancel"),
        ("POST", "/resume"),
        ("GET", "/outputs"),
        ("GET", "/outputs/output.npy"),
        ("DELETE", ""),
    ):
        answer = b.request(method, f"/v2/batches/{batch_id}{path}")
        same_as_unknown(answer, batch_id, unknown, probe)
    assert b.get("/v2/uploads").json() == {"uploads": []}
    assert b.get("/v2/batches").json() == {"batches": []}
    assert a.get(f"/v2/batches/{batch_id}").json()["status"] == "completed"  # unchanged

    # A wrong key or none: 401 on every route.
    for client in (http(stack, None), http(stack, None, key="wrong")):
        for method, path in (
            ("POST", "/v2/uploads?name=x.npy"),
            ("GET", "/v2/uploads"),
            ("GET", f"/v2/uploads/{upload_id}"),
            ("DELETE", f"/v2/uploads/{upload_id}"),
            ("POST", "/v2/batches"),
            ("GET", "/v2/batches"),
            ("GET", f"/v2/batches/{batch_id}"),
            ("POST", f"/v2/batches/{batch_id}/cancel"),
            ("POST", f"/v2/batches/{batch_id}/resume"),
            ("GET", f"/v2/batches/{batch_id}/outputs"),
            ("GET", f"/v2/batches/{batch_id}/outputs/output.npy"),
            ("DELETE", f"/v2/batches/{batch_id}"),
        ):
            assert client.request(method, path).status_code == 401, (method, path)
    assert stored_files(store, "team-b", "") == []


def test_bad_uploads_say_which_field_and_leave_nothing_behind(
    stack: Stack, store: Path, redis: Redis
) -> None:
    c = http(stack, "c")
    for name in ("", "../x.npy", "x.csv", "a b.npy", ".npy", "x" * 300 + ".npy"):
        answer = c.post("/v2/uploads", params={"name": name}, content=b"1")
        assert answer.status_code == 400 and "'name'" in answer.json()["error"], (name, answer.text)
    answer = c.post("/v2/uploads", content=b"1")
    assert answer.status_code == 400 and "'name'" in answer.json()["error"]
    bad_header = c.post(
        "/v2/uploads?name=x.npy", content=b"1", headers={"Sluice-Content-SHA256": "zz"}
    )
    assert bad_header.status_code == 400 and "Sluice-Content-SHA256" in bad_header.json()["error"]
    wrong = c.post(
        "/v2/uploads?name=x.npy", content=b"abc", headers={"Sluice-Content-SHA256": "0" * 64}
    )
    assert wrong.status_code == 400 and "does not match" in wrong.json()["error"]
    too_large = c.post("/v2/uploads?name=x.npy", content=b"\0" * (MAX_UPLOAD + 1))
    assert too_large.status_code == 413 and "SLUICE_MAX_UPLOAD_BYTES" in too_large.json()["error"]

    def chunks(total: int) -> Iterator[bytes]:
        for _ in range(total // 65_536):
            yield b"\1" * 65_536

    chunked = c.post("/v2/uploads?name=x.npy", content=chunks(MAX_UPLOAD + 65_536))
    assert chunked.status_code == 413, chunked.text
    interrupted_upload(stack, KEYS["c"])
    assert c.get("/v2/uploads").json() == {"uploads": []}
    # The gateway notices the client gone, removes the partial file, then gives its bytes
    # back: each one is waited for (the file may be gone before the bytes are back).
    assert wait_until(lambda: stored_files(store, "team-c", "uploads") == [], 30)
    stored = Keys(stack.namespace).stored_bytes("team-c")
    assert wait_until(lambda: int(redis.get(stored) or 0) == 0, 30), redis.get(stored)

    fine = c.post("/v2/uploads?name=ok.jsonl", content=chunks(1 << 20))  # chunked: streamed
    assert fine.status_code == 201, fine.text
    assert fine.json()["bytes"] == 1 << 20
    assert c.delete(f"/v2/uploads/{fine.json()['id']}").status_code == 204
    assert c.get(f"/v2/uploads/{fine.json()['id']}").status_code == 404
    assert stored_files(store, "team-c", "uploads") == []


def interrupted_upload(stack: Stack, key: str) -> None:
    """A client that promises 1 MiB, sends 100 KiB and goes away."""
    with socket.create_connection(("127.0.0.1", stack.port), timeout=10) as raw:
        raw.sendall(
            (
                "POST /v2/uploads?name=cut.npy HTTP/1.1\r\nHost: x\r\n"
                f"Authorization: Bearer {key}\r\nContent-Length: {1 << 20}\r\n\r\n"
            ).encode()
            + b"\0" * 102_400
        )
        time.sleep(0.5)


def test_the_stored_bytes_quota_is_per_tenant_with_retry_after(stack: Stack) -> None:
    c, a = http(stack, "c"), http(stack, "a")
    first = upload(c, b"\2" * (1800 << 10), "first.npy")
    refused = c.post("/v2/uploads?name=second.npy", content=b"\2" * (1800 << 10))
    assert refused.status_code == 429, refused.text
    assert "SLUICE_TENANT_MAX_STORED_BYTES" in refused.json()["error"]
    assert int(refused.headers["retry-after"]) > 0
    assert a.post("/v2/uploads?name=other.npy", content=b"\2" * (1800 << 10)).status_code == 201
    assert c.delete(f"/v2/uploads/{first['id']}").status_code == 204
    upload(c, b"\2" * (1800 << 10), "second.npy")


def test_many_batches_of_b_do_not_hide_those_of_a(stack: Stack) -> None:
    """Defect 10: the listing is per tenant."""
    a, b = http(stack, "a"), http(stack, "b")
    rows = np.zeros((4, 16), dtype=np.float32)
    mine = a.post(
        "/v2/batches", json={"model": "mlp", "input": f"upload:{upload(a, npy(rows))['id']}"}
    ).json()["id"]
    theirs = upload(b, npy(rows))["id"]
    for _ in range(101):
        answer = b.post("/v2/batches", json={"model": "mlp", "input": f"upload:{theirs}"})
        assert answer.status_code == 201, answer.text
    assert mine in [x["id"] for x in a.get("/v2/batches").json()["batches"]]
    listed = b.get("/v2/batches").json()["batches"]
    assert len(listed) == 100 and mine not in [x["id"] for x in listed]
    # B's batches end now, so that no later test waits on a loaded machine for 101 to run.
    for item in listed:
        assert b.post(f"/v2/batches/{item['id']}/cancel").status_code == 200


def test_finished_batches_and_uploads_expire_with_their_files(
    stack: Stack, store: Path, redis: Redis
) -> None:
    """Defect 10: after SLUICE_BATCH_RETENTION_S (7 days) a finished batch's record, listing
    entry and files go, and then the upload it used (the sweeper of the batch workers, run
    here as it would run then)."""
    a = http(stack, "a")
    rows = np.ones((10, 16), dtype=np.float32)
    upload_id = upload(a, npy(rows))["id"]
    batch_id = a.post("/v2/batches", json={"model": "mlp", "input": f"upload:{upload_id}"}).json()[
        "id"
    ]
    assert wait_finished(a, batch_id)["status"] == "completed"
    assert (store / "team-a" / "batches" / batch_id / "output.npy").is_file()
    b = http(stack, "b")
    assert wait_until(
        lambda: all(x["status"] in FINISHED for x in b.get("/v2/batches").json()["batches"]), 100
    )
    keys = Keys(stack.namespace)
    settings = BatchSettings(batch_store=str(store))
    sweeper = StoreSweeper(redis, keys, open_store(settings))
    sweeper.sweep(time.time() + 3600)  # an hour on: nothing of this has expired
    assert a.get(f"/v2/batches/{batch_id}").status_code == 200
    assert a.get(f"/v2/uploads/{upload_id}").status_code == 200
    later = time.time() + 8 * 86_400
    # Rounds of at most 100 items each, as the store sweepers make them; the
    # uploads the expired batches release fall due in a later round than those batches.
    for _ in range(20):
        sweeper.sweep(later)
    assert a.get(f"/v2/batches/{batch_id}").status_code == 404
    assert batch_id not in [x["id"] for x in a.get("/v2/batches").json()["batches"]]
    assert a.get(f"/v2/uploads/{upload_id}").status_code == 404
    assert not (store / "team-a" / "batches" / batch_id).exists()
    for tenant in ("team-a", "team-b", "team-c"):
        assert int(redis.get(keys.stored_bytes(tenant)) or 0) == 0, tenant
        assert stored_files(store, tenant, "") == [], tenant
