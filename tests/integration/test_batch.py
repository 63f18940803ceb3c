"""Offline batch jobs against a running stack with its Celery batch worker (real Redis
broker): a million rows through the tiny model and 20,000 through the CNN, equal to
onnxruntime in-process and in input order; the batch worker killed mid-job and started
again (by ``sluice up``) finishes it with no row missing or twice; the same job from and to
S3 (moto's server over HTTP); Parquet and JSON Lines; bad requests; cancel and resume; and
``sluice batch`` from the terminal. This stack has no batch store: its jobs use the
operator's ``SLUICE_BATCH_ROOT`` and an allowed S3 pattern, and each writes under its own
id in the output folder it names."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import httpx
import numpy as np
import onnxruntime as ort
import pytest
from redis import Redis

from sluice.client import Client
from sluice.core.keys import Keys
from sluice.scheduler.executor.redis_server import RedisServer
from tests.support.procs import children, cmdline, wait_until
from tests.support.stack import Stack

EXAMPLES = Path(__file__).resolve().parents[2] / "model_repository"
CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "sluice-test",
    "AWS_SECRET_ACCESS_KEY": "sluice-test-secret",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
}
FINISHED = ("completed", "failed", "cancelled")
MAX_INPUT_BYTES = 1 << 20


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The batch root: the data sets and outputs live here."""
    return tmp_path_factory.mktemp("batch-root")


@pytest.fixture(scope="module")
def stack(
    tmp_path_factory: pytest.TempPathFactory,
    redis_server: RedisServer,
    root: Path,
    s3_endpoint: str,
) -> Iterator[Stack]:
    repository = tmp_path_factory.mktemp("batch-models")
    for name in ("mlp", "cnn"):
        shutil.copytree(EXAMPLES / name, repository / name)
    env = {
        "SLUICE_BATCH_ROOT": str(root),
        "SLUICE_BATCH_STORE": "",
        "SLUICE_BATCH_ALLOWED_LOCATIONS": r"*=s3://data-[0-9a-f]{10}/.*",
        "SLUICE_MAX_BATCH_INPUT_BYTES": str(MAX_INPUT_BYTES),
        "SLUICE_BATCH_SHARD_LEASE_S": "3",
        "SLUICE_BATCH_WORKERS": "1",
        "SLUICE_S3_ENDPOINT_URL": s3_endpoint,
        **CREDENTIALS,
    }
    stack = Stack(repository, redis_server.url, env=env)
    stack.start()
    yield stack
    stack.stop()


@pytest.fixture(scope="module")
def client(stack: Stack) -> Iterator[Client]:
    with Client(stack.url, timeout_s=60) as client:
        yield client


def in_process(model: str, rows: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(str(EXAMPLES / model / "1" / "model.onnx"))
    name = session.get_inputs()[0].name
    step = 256  # (the CNN's activations for thousands of images at once take gigabytes)
    parts = [session.run(None, {name: rows[i : i + step]})[0] for i in range(0, len(rows), step)]
    return np.concatenate(parts)


def wait_finished(client: Client, batch_id: str, timeout_s: float = 240) -> dict[str, Any]:
    assert wait_until(lambda: client.batch(batch_id)["status"] in FINISHED, timeout_s, 0.25), (
        client.batch(batch_id)
    )
    return client.batch(batch_id)


def batch_worker_pid(stack: Stack) -> int | None:
    assert stack.process is not None
    for pid in children(stack.process.pid):
        argv = cmdline(pid)
        if argv[1:3] == ["-m", "sluice.batch"]:
            return pid
    return None


def test_a_million_rows_through_the_tiny_model_in_order(
    client: Client, root: Path, stack: Stack
) -> None:
    rng = np.random.default_rng(1)
    rows = rng.standard_normal((1_000_000, 16), dtype=np.float32)
    np.save(root / "tiny.npy", rows)
    started = time.monotonic()
    state = client.submit_batch("mlp", str(root / "tiny.npy"), str(root / "tiny-out"))
    state = wait_finished(client, state["id"])
    seconds = time.monotonic() - started
    assert state["status"] == "completed", state
    assert state["rows_done"] == state["rows_total"] == 1_000_000
    print(f"1,000,000 rows through mlp in {seconds:.1f} s ({1e6 / seconds:,.0f} rows/s)")
    out = root / "tiny-out" / state["id"]
    manifest = json.loads((out / "_manifest.json").read_text())
    assert manifest["rows"] == 1_000_000 and manifest["model"] == "mlp"
    starts = [part["rows"][0] for part in manifest["parts"]]
    assert starts == sorted(starts) and starts[0] == 0
    assert state["manifest"] == f"{root}/tiny-out/{state['id']}/_manifest.json"
    output = np.load(out / "output.npy")
    np.testing.assert_allclose(output, in_process("mlp", rows), rtol=1e-5, atol=1e-5)


@pytest.mark.timeout(400)
def test_the_cnn_job_survives_its_batch_worker_killed_mid_job(
    client: Client, root: Path, stack: Stack
) -> None:
    total = 1_000  # rows: seconds of the CNN on two cores, in 8 shards
    rng = np.random.default_rng(2)
    images = rng.standard_normal((total, 3, 64, 64), dtype=np.float32)
    np.save(root / "images.npy", images)
    state = client.submit_batch(
        "cnn", str(root / "images.npy"), str(root / "images-out"), shard_rows=total // 8
    )
    batch_id = state["id"]
    # Killed once a shard is done and another one's attempt is under way (taken, not yet
    # committed): a kill between two shards would leave nothing to try again.
    redis = Redis.from_url(stack.redis_url or "")
    keys = Keys(stack.namespace)

    def one_under_way() -> bool:
        attempted = set(redis.hkeys(keys.batch_attempts(batch_id)))
        return bool(attempted - set(redis.hkeys(keys.batch_shards(batch_id))))

    assert wait_until(lambda: client.batch(batch_id)["rows_done"] >= total // 4, 120, 0.1)
    assert wait_until(one_under_way, 60, 0.01)
    redis.close()
    pid = batch_worker_pid(stack)
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    killed_at = client.batch(batch_id)["rows_done"]
    # sluice up starts the batch worker again; the shard the dead one held is queued again
    # once its lease (3 s here) has run out, and runs as a new attempt.
    assert wait_until(lambda: batch_worker_pid(stack) not in (None, pid), 30)
    state = wait_finished(client, batch_id, 300)
    assert state["status"] == "completed", state
    assert state["rows_done"] == total
    output = np.load(root / "images-out" / batch_id / "output.npy")
    assert output.shape == (total, 10)
    np.testing.assert_allclose(output, in_process("cnn", images), rtol=1e-4, atol=1e-4)
    metrics = httpx.get(f"{stack.url}/metrics", timeout=10).text
    retries = [
        float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith('sluice_batch_shard_retries_total{model="cnn"')
    ]
    print(f"killed at {killed_at} rows; shard retries {retries}")
    assert retries and retries[0] >= 1


def test_the_same_job_from_and_to_s3(client: Client, s3_endpoint: str) -> None:
    s3 = boto3.client(
        "s3",
        endpoint_url=s3_endpoint,
        region_name="us-east-1",
        aws_access_key_id=CREDENTIALS["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
    )
    bucket = f"data-{uuid.uuid4().hex[:10]}"
    s3.create_bucket(Bucket=bucket)
    rows = np.random.default_rng(3).standard_normal((5_000, 16), dtype=np.float32)
    scratch = Path(f"/tmp/{bucket}.npy")
    np.save(scratch, rows)
    s3.upload_file(str(scratch), bucket, "in/rows.npy")
    scratch.unlink()
    state = client.submit_batch(
        "mlp", f"s3://{bucket}/in/rows.npy", f"s3://{bucket}/out/", shard_rows=2_000
    )
    state = wait_finished(client, state["id"])
    assert state["status"] == "completed", state
    key = f"out/{state['id']}/_manifest.json"
    manifest = json.loads(s3.get_object(Bucket=bucket, Key=key)["Body"].read())
    assert state["manifest"] == f"s3://{bucket}/{key}"
    parts = []
    for part in manifest["parts"]:
        key = f"out/{state['id']}/{part['files']['output']}"
        local = Path(f"/tmp/{bucket}-{part['rows'][0]}.npy")
        s3.download_file(bucket, key, str(local))
        parts.append(np.load(local))
        local.unlink()
    output = np.concatenate(parts)
    np.testing.assert_allclose(output, in_process("mlp", rows), rtol=1e-5, atol=1e-5)
    # The parts are joined on S3 too: one output.npy, in input order.
    assert manifest["outputs"] == {"output": "output.npy"}
    joined = Path(f"/tmp/{bucket}-joined.npy")
    s3.download_file(bucket, f"out/{state['id']}/output.npy", str(joined))
    np.testing.assert_array_equal(np.load(joined), output)
    joined.unlink()


def test_parquet_in_and_out(client: Client, root: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = np.random.default_rng(4).standard_normal((3_000, 16), dtype=np.float32)
    pq.write_table(pa.table({"input": list(rows)}), root / "rows.parquet", row_group_size=700)
    state = client.submit_batch(
        "mlp",
        str(root / "rows.parquet"),
        str(root / "pq-out"),
        output_format="parquet",
        shard_rows=1_000,
    )
    state = wait_finished(client, state["id"])
    assert state["status"] == "completed", state
    out = root / "pq-out" / state["id"]
    manifest = json.loads((out / "_manifest.json").read_text())
    tables = [pq.read_table(out / part["files"][""]) for part in manifest["parts"]]
    output = np.stack(pa.concat_tables(tables).column("output").to_pylist())
    np.testing.assert_allclose(output, in_process("mlp", rows), rtol=1e-5, atol=1e-5)


def test_npz_with_float64_data_is_converted(client: Client, root: Path) -> None:
    rows = np.random.default_rng(8).standard_normal((1_500, 16))  # float64: converted to FP32
    np.savez(root / "rows.npz", input=rows)
    state = client.submit_batch(
        "mlp", str(root / "rows.npz"), str(root / "npz-out"), shard_rows=600, in_flight=2
    )
    state = wait_finished(client, state["id"])
    assert state["status"] == "completed" and state["shards"] == {
        "total": 3,
        "done": 3,
        "failed": 0,
    }
    output = np.load(root / "npz-out" / state["id"] / "output.npy")
    expected = in_process("mlp", rows.astype(np.float32))
    np.testing.assert_allclose(output, expected, rtol=1e-5, atol=1e-5)


def test_json_lines_of_v2_requests(client: Client, root: Path) -> None:
    rows = np.random.default_rng(5).standard_normal((30, 16), dtype=np.float32)
    with (root / "requests.jsonl").open("w") as stream:
        for index in range(10):
            chunk = rows[index * 3 : index * 3 + 3]
            request = {
                "id": f"r{index}",
                "inputs": [
                    {
                        "name": "input",
                        "shape": [3, 16],
                        "datatype": "FP32",
                        "data": chunk.reshape(-1).tolist(),
                    }
                ],
            }
            stream.write(json.dumps(request) + "\n")
    state = client.submit_batch("mlp", str(root / "requests.jsonl"), str(root / "jl-out"))
    state = wait_finished(client, state["id"])
    assert state["status"] == "completed", state
    out = root / "jl-out" / state["id"]
    manifest = json.loads((out / "_manifest.json").read_text())
    answers = [
        json.loads(line)
        for part in manifest["parts"]
        for line in (out / part["files"][""]).read_text().splitlines()
    ]
    assert [a["id"] for a in answers] == [f"r{i}" for i in range(10)]
    output = np.array([a["outputs"][0]["data"] for a in answers], dtype=np.float32).reshape(30, 4)
    np.testing.assert_allclose(output, in_process("mlp", rows), rtol=1e-5, atol=1e-5)


def test_bad_batch_requests_say_which_field(stack: Stack, root: Path) -> None:
    url = f"{stack.url}/v2/batches"
    good = {"model": "mlp", "input": str(root / "tiny.npy"), "output": str(root / "x")}
    for body, text in (
        ({**good, "model": "../x"}, "'model'"),
        ({**good, "input": "relative/path.npy"}, "'input' must be an absolute path"),
        ({**good, "input": "/data/../etc/passwd.npy"}, "'input' must not contain '..'"),
        ({**good, "input": "ftp://host/x.npy"}, "'input': only local paths"),
        ({**good, "input": str(root / "x.csv")}, "cannot tell the format"),
        ({**good, "options": {"shard_rows": 0}}, "'options.shard_rows'"),
        ({**good, "options": {"in_flight": "8"}}, "'options.in_flight'"),
        ({**good, "options": {"bogus": 1}}, "unknown field"),
        ({**good, "version": 7}, "does not serve version 7"),
        ({**good, "extra": 1}, "unknown field"),
    ):
        answer = httpx.post(url, json=body, timeout=10)
        assert answer.status_code == 400, (body, answer.text)
        assert text in answer.json()["error"], (text, answer.json())
    assert httpx.post(url, json={**good, "model": "nope"}, timeout=10).status_code == 404
    for batch_id in ("0" * 32, "../../x", "z" * 3000):
        assert httpx.get(f"{url}/{batch_id}", timeout=10).status_code == 404


def test_paths_outside_the_root_are_refused_and_errors_name_only_the_clients_path(
    stack: Stack, client: Client, root: Path
) -> None:
    """Defect 12: a refusal reads the same whether the path exists or not, and no error
    shows the batch root."""
    url = f"{stack.url}/v2/batches"
    outside = root.parent / f"outside-{uuid.uuid4().hex[:6]}.npy"
    np.save(outside, np.zeros((4, 16), dtype=np.float32))
    (root / "escape.npy").symlink_to(outside)
    try:
        answers = {}
        for source in (str(outside), str(root / "escape.npy"), f"{outside}.missing.npy"):
            answer = httpx.post(
                url, json={"model": "mlp", "input": source, "output": str(root / "n")}, timeout=10
            )
            assert answer.status_code == 403, answer.text
            error = answer.json()["error"]
            assert error.startswith("'input': ") and str(root) not in error.replace(source, "")
            answers[source] = error.replace(source, "<path>")
        assert len(set(answers.values())) == 1, answers  # existing or not: the same words
        missing = client.submit_batch("mlp", str(root / "missing.npy"), str(root / "never"))
        state = wait_finished(client, missing["id"], 60)
        assert state["status"] == "failed", state
        assert state["error"] == f"'input': {root / 'missing.npy'} is not a file"
        wrong = root / "wrong.npy"
        np.save(wrong, np.zeros((4, 15), dtype=np.float32))
        state = wait_finished(client, client.submit_batch("mlp", str(wrong), str(root / "w"))["id"])
        assert state["status"] == "failed" and "do not fit input 'input'" in state["error"]
    finally:
        outside.unlink()
    assert not (root / "never").exists()


def test_s3_locations_not_allowed_and_the_model_repository_are_refused(
    stack: Stack, root: Path
) -> None:
    """Defects 1 and 2: the server's S3 credentials are not the client's, and no output
    lands in the model repository."""
    url = f"{stack.url}/v2/batches"
    rows = str(root / "tiny.npy")
    for body, field in (
        ({"input": "s3://another-teams-bucket/x.npy", "output": str(root / "o")}, "input"),
        ({"input": rows, "output": "s3://models/iris/1/"}, "output"),
        ({"input": rows, "output": f"{stack.repository}/mlp/7"}, "output"),
        ({"input": f"{stack.repository}/mlp/1/model.onnx.npy", "output": str(root)}, "input"),
        ({"input": rows, "output": f"{sys.prefix}/lib"}, "output"),
    ):
        answer = httpx.post(url, json={"model": "mlp", **body}, timeout=10)
        assert answer.status_code == 403, (body, answer.text)
        assert answer.json()["error"].startswith(f"'{field}': "), answer.text
    assert not (Path(stack.repository) / "mlp" / "7").exists()


def test_without_a_batch_store_uploads_and_store_outputs_say_what_to_set(
    stack: Stack, root: Path
) -> None:
    upload = httpx.post(f"{stack.url}/v2/uploads?name=rows.npy", content=b"x", timeout=10)
    assert upload.status_code == 503 and "SLUICE_BATCH_STORE" in upload.json()["error"]
    batch = httpx.post(
        f"{stack.url}/v2/batches", json={"model": "mlp", "input": str(root / "tiny.npy")}
    )
    assert batch.status_code == 503 and "SLUICE_BATCH_STORE" in batch.json()["error"]


def test_two_jobs_with_one_output_folder_keep_their_own_files(client: Client, root: Path) -> None:
    """Defect 3: every job writes under its own id; nothing is replaced or mixed."""
    rng = np.random.default_rng(11)
    first, second = (rng.standard_normal((3_000, 16), dtype=np.float32) for _ in range(2))
    np.save(root / "first.npy", first)
    np.save(root / "second.npy", second)
    shared = str(root / "shared-out")
    one = client.submit_batch("mlp", str(root / "first.npy"), shared, shard_rows=500)
    two = client.submit_batch("mlp", str(root / "second.npy"), shared, shard_rows=500)
    for state, rows in (
        (wait_finished(client, one["id"]), first),
        (wait_finished(client, two["id"]), second),
    ):
        assert state["status"] == "completed", state
        output = np.load(root / "shared-out" / state["id"] / "output.npy")
        np.testing.assert_allclose(output, in_process("mlp", rows), rtol=1e-5, atol=1e-5)
    assert sorted(p.name for p in (root / "shared-out").iterdir()) == sorted([one["id"], two["id"]])


def test_an_s3_input_larger_than_the_cap_fails_the_job_before_downloading(
    client: Client, s3_endpoint: str
) -> None:
    """Defect 11: SLUICE_MAX_BATCH_INPUT_BYTES, checked with a HEAD first."""
    s3 = boto3.client(
        "s3",
        endpoint_url=s3_endpoint,
        region_name="us-east-1",
        aws_access_key_id=CREDENTIALS["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
    )
    bucket = f"data-{uuid.uuid4().hex[:10]}"
    s3.create_bucket(Bucket=bucket)
    s3.put_object(Bucket=bucket, Key="big.npy", Body=b"\0" * (MAX_INPUT_BYTES + 1))
    state = client.submit_batch("mlp", f"s3://{bucket}/big.npy", f"s3://{bucket}/out/")
    state = wait_finished(client, state["id"], 60)
    assert state["status"] == "failed", state
    assert "SLUICE_MAX_BATCH_INPUT_BYTES" in state["error"], state
    assert f"s3://{bucket}/big.npy" in state["error"]


def test_cancel_then_resume(client: Client, root: Path) -> None:
    images = np.random.default_rng(6).standard_normal((1_200, 3, 64, 64), dtype=np.float32)
    np.save(root / "resume.npy", images)
    state = client.submit_batch(
        "cnn", str(root / "resume.npy"), str(root / "resume-out"), shard_rows=200
    )
    batch_id = state["id"]
    assert wait_until(lambda: client.batch(batch_id)["rows_done"] >= 200, 60, 0.1)
    assert client.cancel_batch(batch_id)["status"] == "cancelled"
    time.sleep(2)
    cancelled = client.batch(batch_id)
    assert cancelled["status"] == "cancelled" and cancelled["shards"]["done"] < 6
    client.resume_batch(batch_id)
    state = wait_finished(client, batch_id, 120)
    assert state["status"] == "completed", state
    output = np.load(root / "resume-out" / batch_id / "output.npy")
    np.testing.assert_allclose(output, in_process("cnn", images), rtol=1e-4, atol=1e-4)
    listed = [b["id"] for b in client.batches()]
    assert batch_id in listed


def test_sluice_batch_from_the_terminal(stack: Stack, root: Path) -> None:
    rows = np.random.default_rng(7).standard_normal((2_000, 16), dtype=np.float32)
    np.save(root / "cli.npy", rows)
    command = [sys.executable, "-m", "sluice.cli", "batch"]
    submitted = subprocess.run(
        [
            *command,
            "submit",
            "--model",
            "mlp",
            "--input",
            f"server:{root / 'cli.npy'}",  # on the server's side (a local path: uploaded)
            "--output",
            f"server:{root / 'cli-out'}",
            "--url",
            stack.url,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert submitted.returncode == 0, submitted.stderr
    batch_id = submitted.stdout.split()[1]
    assert "completed" in submitted.stdout and "2,000 of 2,000" in submitted.stdout
    status = subprocess.run(
        [*command, "status", batch_id, "--url", stack.url],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert status.returncode == 0 and "completed" in status.stdout
    listed = subprocess.run(
        [*command, "list", "--url", stack.url], capture_output=True, text=True, timeout=60
    )
    assert batch_id[:8] in listed.stdout
    missing = subprocess.run(
        [*command, "status", "0" * 32, "--url", stack.url],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert missing.returncode == 1 and "error: no batch" in missing.stderr


def test_one_tenants_jobs_beyond_its_bound_wait_in_line_and_start_in_order(
    client: Client, root: Path
) -> None:
    """Without API keys every job is the one tenant's: at most
    SLUICE_TENANT_MAX_RUNNING_BATCHES (4) run at once; the others wait ``queued`` with their
    place and start, in the order they came, as the batch worker ends the running ones."""
    rows = np.random.default_rng(12).standard_normal((100_000, 16), dtype=np.float32)
    np.save(root / "turns.npy", rows)
    jobs = [
        client.submit_batch(
            "mlp", str(root / "turns.npy"), str(root / "turns-out"), shard_rows=10_000
        )
        for _ in range(6)
    ]
    assert [job["status"] for job in jobs[4:]] == ["queued", "queued"], jobs
    assert [job["place"] for job in jobs[4:]] == [1, 2]
    most = 0

    def ended() -> bool:
        nonlocal most
        # Read last job first: a job starts only once one submitted before it ended, so
        # a job that starts between two reads is seen before it started (never a job seen
        # running before it ended and the one that took its turn seen started).
        states = [client.batch(job["id"]) for job in reversed(jobs)]
        most = max(most, sum(state["status"] in ("planning", "running") for state in states))
        return all(state["status"] in FINISHED for state in states)

    assert wait_until(ended, 240, 0.1)
    assert 1 <= most <= 4
    states = [client.batch(job["id"]) for job in jobs]
    assert {state["status"] for state in states} == {"completed"}, states
    started = [state["started"] for state in states]
    assert started == sorted(started)
    output = np.load(root / "turns-out" / jobs[5]["id"] / "output.npy")
    np.testing.assert_allclose(output, in_process("mlp", rows), rtol=1e-5, atol=1e-5)
