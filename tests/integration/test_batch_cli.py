"""``sluice batch`` from a laptop against a real stack (``sluice up`` with its batch worker
and a batch store of its own; no folder shared with the client): a local ``.npy`` is
uploaded, run through ``mlp`` and its outputs downloaded, equal to onnxruntime in-process
row for row; a job that fails says why, first; the Python client does the same round trip."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from sluice.client import AsyncClient, BatchFailed, Client
from sluice.scheduler.executor.redis_server import RedisServer
from tests.support.stack import Stack

EXAMPLES = Path(__file__).resolve().parents[2] / "model_repository"


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("batch-store")


@pytest.fixture(scope="module")
def stack(
    tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer, store: Path
) -> Iterator[Stack]:
    repository = tmp_path_factory.mktemp("cli-models")
    shutil.copytree(EXAMPLES / "mlp", repository / "mlp")
    env = {"SLUICE_BATCH_STORE": str(store), "SLUICE_BATCH_WORKERS": "1"}
    stack = Stack(repository, redis_server.url, env=env)
    stack.start()
    yield stack
    stack.stop()


@pytest.fixture
def laptop(tmp_path: Path) -> Path:
    """The client's working folder: nothing in it is named to the server."""
    folder = tmp_path / "laptop"
    folder.mkdir()
    return folder


def in_process(rows: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(str(EXAMPLES / "mlp" / "1" / "model.onnx"))
    result: np.ndarray = session.run(None, {session.get_inputs()[0].name: rows})[0]
    return result


def sluice_batch(laptop: Path, url: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLUICE_")}
    env["SLUICE_URL"] = url
    return subprocess.run(
        [sys.executable, "-m", "sluice.cli", "batch", *args],
        cwd=laptop,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )


@pytest.mark.timeout(300)
def test_upload_run_and_download_from_the_terminal(stack: Stack, laptop: Path) -> None:
    rows = np.random.default_rng(11).standard_normal((5_000, 16), dtype=np.float32)
    np.save(laptop / "rows.npy", rows)
    done = sluice_batch(
        laptop,
        stack.url,
        *("submit", "--model", "mlp", "--input", "rows.npy", "--output", "out"),
        "--shard-rows",
        "2000",
    )
    assert done.returncode == 0, done.stderr
    batch_id = done.stdout.split()[1]
    assert "completed" in done.stdout and "rows 5,000 of 5,000" in done.stdout
    assert "uploaded rows.npy as upload:" in done.stderr
    out = laptop / "out"
    assert not [path.name for path in out.iterdir() if path.name.startswith(".")]
    output = np.load(out / "output.npy", allow_pickle=False)
    np.testing.assert_allclose(output, in_process(rows), rtol=1e-5, atol=1e-5)
    manifest = json.loads((out / "_manifest.json").read_text())
    assert manifest["rows"] == 5_000 and len(manifest["parts"]) == 3
    for part in manifest["parts"]:  # the parts too, each where the manifest says
        start, end = part["rows"]
        piece = np.load(out / part["files"]["output"], allow_pickle=False)
        np.testing.assert_allclose(piece, output[start:end])

    again = sluice_batch(laptop, stack.url, "download", batch_id, "--output", "again")
    assert again.returncode == 0, again.stderr
    assert (laptop / "again" / "output.npy").read_bytes() == (out / "output.npy").read_bytes()
    listed = sluice_batch(laptop, stack.url, "uploads")
    assert listed.returncode == 0 and "rows.npy" in listed.stdout


def test_a_failing_job_says_why_first(stack: Stack, laptop: Path) -> None:
    np.save(laptop / "wrong.npy", np.zeros((10, 15), dtype=np.float32))
    failed = sluice_batch(
        laptop, stack.url, "submit", "--model", "mlp", "--input", "wrong.npy", "--output", "o"
    )
    assert failed.returncode == 1
    lines = failed.stdout.splitlines()
    assert "failed" in lines[1] and "do not fit input 'input'" in lines[2], failed.stdout
    assert "rows 0" not in failed.stdout and "0/?" not in failed.stdout + failed.stderr
    assert not (laptop / "o").exists()


def test_the_python_clients_round_trip(stack: Stack, laptop: Path) -> None:
    rows = np.random.default_rng(12).standard_normal((300, 16), dtype=np.float32)
    np.save(laptop / "small.npy", rows)
    with Client(stack.url) as client:
        state = client.run_batch("mlp", laptop / "small.npy", laptop / "sync", poll_s=0.2)
        assert state["status"] == "completed" and state["rows_done"] == 300
        names = {item["name"] for item in client.batch_outputs(state["id"])}
        assert {"_manifest.json", "output.npy"} <= names
        np.save(laptop / "bad.npy", np.zeros((3, 7), dtype=np.float32))
        with pytest.raises(BatchFailed, match="do not fit"):
            client.run_batch("mlp", laptop / "bad.npy", laptop / "never", poll_s=0.2)
    output = np.load(laptop / "sync" / "output.npy", allow_pickle=False)
    np.testing.assert_allclose(output, in_process(rows), rtol=1e-5, atol=1e-5)


async def test_the_async_clients_round_trip(stack: Stack, laptop: Path) -> None:
    rows = np.random.default_rng(13).standard_normal((200, 16), dtype=np.float32)
    np.save(laptop / "small.npy", rows)
    async with AsyncClient(stack.url) as client:
        state = await client.run_batch("mlp", laptop / "small.npy", laptop / "async", poll_s=0.2)
        assert state["status"] == "completed"
    output = np.load(laptop / "async" / "output.npy", allow_pickle=False)
    np.testing.assert_allclose(output, in_process(rows), rtol=1e-5, atol=1e-5)
