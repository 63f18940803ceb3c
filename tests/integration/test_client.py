"""sluice.client and ``sluice infer`` against a real stack: sync and async inference in
binary and JSON, FP32, BYTES and INT64 round trips, the server's errors as typed exceptions,
jobs (result, failure, cancellation, idempotency), and retries against a tiny HTTP server of
the test's own that answers 503 before it answers."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import typer
from typer.testing import CliRunner

from sluice.cli.infer_command import infer as infer_command
from sluice.client import (
    AsyncClient,
    Client,
    InferenceFailed,
    InvalidInput,
    Job,
    JobCancelled,
    JobNotFinished,
    NotFound,
    Overloaded,
    ServerUnreachable,
    Unavailable,
)
from sluice.scheduler.executor.redis_server import RedisServer, free_port
from tests.support.load import slow_request
from tests.support.model_files import python_config, tensor, write_double_and_broken, write_model
from tests.support.procs import wait_until
from tests.support.slow_model import write_slow
from tests.support.stack import Stack

ECHO = """
class Model:
    def execute(self, inputs):
        return {"s_out": inputs["s"], "n_out": inputs["n"] + 1}
"""
X = np.array([[1.5, -2.0], [3.0, 4.25]], dtype=np.float32)
TEXT = np.array([[b"hello"], [b"\xff\xfe not utf-8"], [b""]], dtype=np.object_)
NUMBERS = np.array([[-(2**62), 2**62], [0, 7], [1, -1]], dtype=np.int64)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("client")
    write_double_and_broken(root, max_batch_size=64)
    echo = python_config(
        [tensor("s", "TYPE_STRING", "1"), tensor("n", "TYPE_INT64", "2")],
        [tensor("s_out", "TYPE_STRING", "1"), tensor("n_out", "TYPE_INT64", "2")],
    )
    write_model(root, "echo", echo, {"1/model.py": ECHO})
    write_slow(root, "slow", max_batch_size=1)
    stack = Stack(root, redis_server.url)
    stack.start()
    yield stack
    stack.stop()


@pytest.fixture(params=[True, False], ids=["binary", "json"])
def client(request: pytest.FixtureRequest, stack: Stack) -> Iterator[Client]:
    with Client(stack.url, binary=request.param) as client:
        yield client


def assert_same(actual: np.ndarray, expected: np.ndarray) -> None:
    assert actual.shape == expected.shape
    assert actual.dtype == expected.dtype
    assert actual.tolist() == expected.tolist()


# ------------------------------------------------------------------------- inference


def test_ready_and_metadata(client: Client) -> None:
    assert client.ready()
    metadata = client.model_metadata("double")
    assert metadata["name"] == "double" and metadata["inputs"][0]["name"] == "x"
    assert client.model_metadata("double", version=1)["name"] == "double"


def test_fp32_round_trip(client: Client) -> None:
    outputs = client.infer("double", {"x": X}, request_id="fp32")
    assert list(outputs) == ["y"]
    assert_same(outputs["y"], X * 2)
    named = client.infer("double", {"x": X}, outputs=["y"], version=1)
    assert_same(named["y"], X * 2)


def test_bytes_and_int64_round_trip(client: Client) -> None:
    outputs = client.infer("echo", {"s": TEXT, "n": NUMBERS})
    assert outputs["s_out"].dtype == np.object_
    assert outputs["s_out"].tolist() == TEXT.tolist()
    assert_same(outputs["n_out"], NUMBERS + 1)
    only = client.infer("echo", {"s": np.array([["wörds"]]), "n": NUMBERS[:1]}, outputs=["s_out"])
    assert list(only) == ["s_out"] and only["s_out"].tolist() == [["wörds".encode()]]


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
async def test_async_client_round_trips(stack: Stack, binary: bool) -> None:
    async with AsyncClient(stack.url, binary=binary) as client:
        assert await client.ready()
        assert (await client.model_metadata("echo"))["name"] == "echo"
        doubled = await client.infer("double", {"x": X})
        assert_same(doubled["y"], X * 2)
        echoed = await client.infer("echo", {"s": TEXT, "n": NUMBERS})
        assert echoed["s_out"].tolist() == TEXT.tolist()
        assert_same(echoed["n_out"], NUMBERS + 1)
        with pytest.raises(NotFound):
            await client.infer("nope", {"x": X})


def test_infer_json_sends_a_request_as_it_is(stack: Stack) -> None:
    request = {"inputs": [{"name": "x", "shape": [1, 2], "datatype": "FP32", "data": [1, 2]}]}
    with Client(stack.url) as client:
        assert client.infer_json("double", request)["y"].tolist() == [[2.0, 4.0]]


# ---------------------------------------------------------------------------- errors


def test_the_servers_errors_are_typed_exceptions(client: Client, stack: Stack) -> None:
    wrong = np.ones((1, 3), dtype=np.float32)
    with pytest.raises(InvalidInput) as info:
        client.infer("double", {"x": wrong})
    body = {"inputs": [{"name": "x", "shape": [1, 3], "datatype": "FP32", "data": [1, 1, 1]}]}
    raw = httpx.post(f"{stack.url}/v2/models/double/infer", json=body, timeout=30)
    assert raw.status_code == 400
    assert info.value.message == raw.json()["error"]
    with pytest.raises(NotFound, match="nope"):
        client.infer("nope", {"x": X})
    with pytest.raises(NotFound):
        client.model_metadata("double", version=9)
    with pytest.raises(InferenceFailed, match="this model is broken"):
        client.infer("broken", {"x": X})


# ------------------------------------------------------------------------------ jobs


def test_a_job_gives_the_synchronous_answer(client: Client) -> None:
    job = client.submit_job("echo", {"s": TEXT, "n": NUMBERS})
    assert isinstance(job, Job) and job.url.endswith(f"/v2/jobs/{job.id}")
    assert job.status["status"] in ("queued", "in_progress", "completed")
    outputs = client.job_result(job, wait_s=30)
    assert outputs["s_out"].tolist() == TEXT.tolist()
    assert_same(outputs["n_out"], NUMBERS + 1)
    status = client.job(job.id)
    assert status["status"] == "completed" and status["model"] == "echo"
    assert_same(client.wait_job(job.id, timeout_s=10)["n_out"], NUMBERS + 1)


def test_an_idempotency_key_returns_the_same_job(client: Client) -> None:
    # One key per encoding: the same key with another body (binary, JSON) is a conflict.
    key = f"client-order-{'binary' if client.binary else 'json'}"
    first = client.submit_job("double", {"x": X}, idempotency_key=f"{key}-1")
    again = client.submit_job("double", {"x": X}, idempotency_key=f"{key}-1")
    other = client.submit_job("double", {"x": X}, idempotency_key=f"{key}-2")
    assert first.id == again.id != other.id
    with pytest.raises(InvalidInput, match="idempotency key"):
        client.submit_job("double", {"x": X}, idempotency_key="has space")


def test_failed_cancelled_and_unknown_jobs_raise(client: Client) -> None:
    failed = client.submit_job("broken", {"x": X})
    with pytest.raises(InferenceFailed, match="this model is broken"):
        client.wait_job(failed, timeout_s=30)
    assert client.job(failed)["status"] == "failed"
    with pytest.raises(NotFound):
        client.job("0" * 32)
    with pytest.raises(InvalidInput):
        client.submit_job("double", {"x": np.ones((1, 3), np.float32)})


def test_a_queued_job_is_cancelled(stack: Stack) -> None:
    with Client(stack.url) as client:
        busy = slow_request(1, 200_000)  # keeps the slow model's one instance busy ~2 s
        blocker = client.submit_job_json("slow", busy)
        assert wait_until(lambda: client.job(blocker)["status"] != "queued", 30)
        queued = client.submit_job("slow", slow_inputs(2))
        with pytest.raises(JobNotFinished) as info:
            client.job_result(queued, wait_s=0)
        assert info.value.job["status"] == "queued"
        assert client.cancel_job(queued)["status"] == "cancelled"
        with pytest.raises(JobCancelled, match="cancelled"):
            client.job_result(queued)
        assert client.cancel_job(blocker)["status"] in ("cancelling", "cancelled", "completed")
        with pytest.raises(JobNotFinished, match="did not finish within 0 s"):
            client.wait_job(client.submit_job("slow", slow_inputs(3)), timeout_s=0)


def slow_inputs(index: int) -> dict[str, np.ndarray]:
    request = slow_request(index, 10)
    return {
        item["name"]: np.array(
            item["data"], dtype=np.float32 if item["name"] == "IN" else np.int64
        ).reshape(item["shape"])
        for item in request["inputs"]
    }


async def test_async_jobs(stack: Stack) -> None:
    async with AsyncClient(stack.url) as client:
        job = await client.submit_job("double", {"x": X}, request_id="async-job-1")
        assert_same((await client.wait_job(job, timeout_s=30))["y"], X * 2)
        assert (await client.job(job))["status"] == "completed"
        again = await client.submit_job("double", {"x": X}, request_id="async-job-1")
        assert again.id == job.id
        with pytest.raises(InferenceFailed):
            await client.job_result(await client.submit_job("broken", {"x": X}), wait_s=30)


# --------------------------------------------------------------------------- retries


@dataclass
class Script:
    """What the tiny server answers: ``refusals`` times ``status`` (with ``retry_after``
    when set), then a valid inference answer; every request's headers are kept."""

    refusals: int
    status: int = 503
    retry_after: str | None = "0"
    requests: list[dict[str, str]] = field(default_factory=list)


ANSWER = {
    "model_name": "m",
    "model_version": "1",
    "outputs": [{"name": "y", "datatype": "FP32", "shape": [1, 2], "data": [2.0, 4.0]}],
}


@pytest.fixture
def tiny() -> Iterator[Callable[[Script], str]]:
    """Start a stdlib HTTP server on a free loopback port following a script; its URL."""
    servers: list[tuple[ThreadingHTTPServer, threading.Thread]] = []

    def start(script: Script) -> str:
        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length", "0")))
                script.requests.append(dict(self.headers))
                if len(script.requests) <= script.refusals:
                    self._answer(script.status, {"error": "busy, come back"}, script.retry_after)
                else:
                    self._answer(200, ANSWER, None)

            do_GET = do_POST

            def _answer(self, status: int, document: Any, retry_after: str | None) -> None:
                content = json.dumps(document).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(content)))
                if retry_after is not None:
                    self.send_header("Retry-After", retry_after)
                self.end_headers()
                self.wfile.write(content)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        server.daemon_threads = True
        thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
        thread.start()
        servers.append((server, thread))
        return f"http://127.0.0.1:{server.server_address[1]}"

    yield start
    for server, thread in servers:
        server.shutdown()
        server.server_close()
        thread.join(5)


def test_503_with_retry_after_is_retried(tiny: Callable[[Script], str]) -> None:
    script = Script(refusals=2)
    with Client(tiny(script), api_key="secret", retries=5) as client:
        outputs = client.infer("m", {"x": X[:1]})
    assert outputs["y"].tolist() == [[2.0, 4.0]]
    assert len(script.requests) == 3
    assert all(r["Authorization"] == "Bearer secret" for r in script.requests)


def test_429_without_retry_after_backs_off_and_is_retried(tiny: Callable[[Script], str]) -> None:
    script = Script(refusals=3, status=429, retry_after=None)
    with Client(tiny(script), retries=3) as client:
        assert client.infer("m", {"x": X[:1]})["y"].shape == (1, 2)
    assert len(script.requests) == 4
    assert "Authorization" not in script.requests[0]


def test_the_client_gives_up_after_its_retries(tiny: Callable[[Script], str]) -> None:
    script = Script(refusals=100, retry_after=None)
    with Client(tiny(script), retries=2) as client, pytest.raises(Unavailable, match="busy"):
        client.infer("m", {"x": X[:1]})
    assert len(script.requests) == 3
    overloaded = Script(refusals=100, retry_after="0")
    with Client(tiny(overloaded), retries=0) as client, pytest.raises(Overloaded) as info:
        client.infer("m", {"x": X[:1]})
    assert len(overloaded.requests) == 1 and info.value.retry_after_s == 0


async def test_the_async_client_retries_too(tiny: Callable[[Script], str]) -> None:
    script = Script(refusals=2)
    async with AsyncClient(tiny(script), retries=2) as client:
        assert (await client.infer("m", {"x": X[:1]}))["y"].tolist() == [[2.0, 4.0]]
    assert len(script.requests) == 3
    gives_up = Script(refusals=100)
    async with AsyncClient(tiny(gives_up), retries=1) as client:
        with pytest.raises(Overloaded):
            await client.infer("m", {"x": X[:1]})
    assert len(gives_up.requests) == 2


def test_an_unreachable_server(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    with Client(url, retries=2) as client:
        assert not client.ready()
        with pytest.raises(ServerUnreachable, match="cannot reach"):
            client.infer("m", {"x": X})


# ------------------------------------------------------------------------ sluice infer


def cli() -> typer.Typer:
    app = typer.Typer()
    app.command()(infer_command)
    return app


def test_cli_infers_from_npy_files_and_saves_outputs(stack: Stack, tmp_path: Path) -> None:
    np.save(tmp_path / "x.npy", X)
    big = np.arange(128, dtype=np.float32).reshape(64, 2)
    np.save(tmp_path / "big.npy", big)
    runner = CliRunner()
    result = runner.invoke(
        cli(), ["double", "--input", f"x={tmp_path / 'x.npy'}", "--url", stack.url]
    )
    assert result.exit_code == 0, result.output
    assert "y  FP32  [2, 2]" in result.stdout
    assert "[[ 3.  -4. ]" in result.stdout and "[ 6.   8.5]]" in result.stdout
    out = tmp_path / "out"
    args = ["double", "-i", f"x={tmp_path / 'big.npy'}", "--url", stack.url, "--save-dir", out]
    result = runner.invoke(cli(), [str(arg) for arg in args])
    assert result.exit_code == 0, result.output
    assert "y  FP32  [64, 2]" in result.stdout
    assert "128 elements: min 0, max 254, mean 127" in result.stdout
    assert_same(np.load(out / "y.npy"), big * 2)


def test_cli_async_job_and_bytes_outputs(stack: Stack, tmp_path: Path) -> None:
    np.save(tmp_path / "s.npy", np.array([["hi there"]]))
    np.save(tmp_path / "n.npy", NUMBERS[:1])
    inputs = ["-i", f"s={tmp_path / 's.npy'}", "-i", f"n={tmp_path / 'n.npy'}"]
    args = ["echo", *inputs, "--url", stack.url, "--async", "--save-dir", str(tmp_path)]
    result = CliRunner().invoke(cli(), args)
    assert result.exit_code == 0, result.output
    assert "submitted job" in result.stderr and "completed" in result.stderr
    assert "s_out  BYTES  [1, 1]" in result.stdout
    assert np.load(tmp_path / "s_out.npy").tolist() == [[b"hi there"]]  # no pickle needed
    assert_same(np.load(tmp_path / "n_out.npy"), NUMBERS[:1] + 1)


def test_cli_sends_a_json_request(stack: Stack, tmp_path: Path) -> None:
    request = {"inputs": [{"name": "x", "shape": [1, 2], "datatype": "FP32", "data": [1, 2]}]}
    (tmp_path / "request.json").write_text(json.dumps(request))
    args = ["double", "--json", str(tmp_path / "request.json"), "--url", stack.url]
    result = CliRunner().invoke(cli(), args)
    assert result.exit_code == 0, result.output
    assert "[[2. 4.]]" in result.stdout


def test_cli_server_errors_exit_1_with_the_message(stack: Stack, tmp_path: Path) -> None:
    np.save(tmp_path / "x.npy", np.ones((1, 3), dtype=np.float32))
    runner = CliRunner()
    result = runner.invoke(cli(), ["double", "-i", f"x={tmp_path / 'x.npy'}", "--url", stack.url])
    assert result.exit_code == 1
    assert result.stderr.startswith("error: ") and "[1,3]" in result.stderr
    result = runner.invoke(cli(), ["nope", "-i", f"x={tmp_path / 'x.npy'}", "--url", stack.url])
    assert result.exit_code == 1 and "error: " in result.stderr and "nope" in result.stderr


@pytest.mark.parametrize(
    ("argument", "message"),
    [
        ("x", "--input 'x': expected NAME=path.npy"),
        ("=a.npy", "expected NAME=path.npy"),
        ("x=missing.npy", "no file missing.npy"),
        ("x=not.npy", "not.npy is not a .npy file"),
        ("x=empty.npy", "empty.npy is not a readable .npy file"),
        ("x=objects.npy", "objects.npy holds an object array, refused"),
        ("x=.", "cannot read ."),
    ],
)
def test_cli_bad_inputs_exit_2(
    argument: str, message: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "not.npy").write_text("plain text")
    (tmp_path / "empty.npy").write_bytes(b"")
    np.save(tmp_path / "objects.npy", np.array([b"a", None], dtype=np.object_))
    result = CliRunner().invoke(cli(), ["double", "--input", argument, "--url", "http://x"])
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith("error: --input") and message in result.stderr
