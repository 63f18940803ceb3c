"""``sluice batch`` and the client's uploads and downloads against a small HTTP server of the
tests' own that speaks the gateway's API (tests/support/fake_batch_gateway.py): a local file
uploaded with its sha256, the job followed, its outputs downloaded whole or not at all;
locations on the server passed as they are; bad local paths refused before anything is
sent; a failed job's reason first; a corrupted, cut or hostile download refused."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from sluice.cli import app, batch_command
from sluice.cli.batch_command import batch_app
from sluice.client import AsyncClient, BatchFailed, Client, MalformedResponse, QuotaExceeded
from tests.support.fake_batch_gateway import FakeGateway, fake_gateway

DATA = os.urandom(3 * (1 << 20) + 12345)  # more than one chunk, not a whole number of them


@pytest.fixture(autouse=True)
def quick_polls(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(batch_command, "_POLL_S", 0.01)
    monkeypatch.delenv("SLUICE_URL", raising=False)
    monkeypatch.delenv("SLUICE_API_KEY", raising=False)


@pytest.fixture
def gateway() -> Iterator[tuple[str, FakeGateway]]:
    with fake_gateway() as served:
        yield served


@pytest.fixture
def rows(tmp_path: Path) -> Path:
    path = tmp_path / "rows.npy"
    path.write_bytes(DATA)
    return path


def run(*args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    result = CliRunner().invoke(batch_app, list(args), env=env)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, result.stdout, result.stderr


def leftovers(folder: Path) -> list[str]:
    return sorted(path.name for path in folder.rglob("*") if path.name.startswith("."))


def test_submit_uploads_runs_and_downloads(
    gateway: tuple[str, FakeGateway], rows: Path, tmp_path: Path
) -> None:
    url, fake = gateway
    out = tmp_path / "results" / "out"
    code, stdout, stderr = run(
        "submit", "--model", "mlp", "--input", str(rows), "--output", str(out), "--url", url
    )
    assert code == 0, stderr
    (upload,) = fake.uploads.values()
    assert upload["bytes"] == len(DATA) and upload["name"] == "rows.npy"
    assert upload["sha256"] == hashlib.sha256(DATA).hexdigest()
    (document,) = fake.submitted
    assert document["input"] == f"upload:{upload['id']}" and "output" not in document
    assert (out / "output.bin").read_bytes() == DATA[::-1]
    assert (out / "_manifest.json").exists() and leftovers(out) == []
    assert stdout.splitlines()[0].startswith("batch ") and "completed" in stdout
    assert "rows 1,000 of 1,000" in stdout and "downloaded 2 files" in stdout
    sent = [headers for method, path, headers in fake.requests if path == "/v2/uploads"]
    assert sent[0]["Content-Length"] == str(len(DATA)) and "Transfer-Encoding" not in sent[0]


def test_the_gateway_comes_from_sluice_url(
    gateway: tuple[str, FakeGateway], rows: Path, tmp_path: Path
) -> None:
    url, fake = gateway
    code, stdout, stderr = run(
        "submit", "--model", "mlp", "--input", str(rows), "--no-watch", env={"SLUICE_URL": url}
    )
    assert code == 0, stderr
    assert len(fake.submitted) == 1
    batch_id = stdout.split()[1]
    assert f"sluice batch download {batch_id} --output DIR" in stdout
    code, stdout, _ = run("status", batch_id, env={"SLUICE_URL": url})
    assert code == 0 and batch_id in stdout


@pytest.mark.parametrize(
    ("given", "sent_input", "given_output", "sent_output"),
    [
        ("s3://data/rows.npy", "s3://data/rows.npy", "s3://data/out/", "s3://data/out/"),
        ("server:/data/rows.npy", "/data/rows.npy", "server:/data/out", "/data/out"),
        ("upload:" + "a" * 32, "upload:" + "a" * 32, None, None),
    ],
)
def test_server_side_locations_are_passed_as_they_are(
    gateway: tuple[str, FakeGateway],
    given: str,
    sent_input: str,
    given_output: str | None,
    sent_output: str | None,
) -> None:
    url, fake = gateway
    output = [] if given_output is None else ["--output", given_output]
    run("submit", "--model", "mlp", "--input", given, *output, "--url", url, "--no-watch")
    assert fake.count("POST", "/v2/uploads") == 0
    (document,) = fake.submitted
    assert document["input"] == sent_input and document.get("output") == sent_output


def test_bad_local_paths_are_refused_before_anything_is_sent(
    gateway: tuple[str, FakeGateway], rows: Path, tmp_path: Path
) -> None:
    url, fake = gateway
    a_file = tmp_path / "taken"
    a_file.write_text("x")
    for arguments, message in (
        (["--input", str(tmp_path / "missing.npy")], "missing.npy: no such file"),
        (["--input", str(tmp_path)], "is a folder"),
        (["--input", str(rows), "--output", str(a_file)], "taken is a file, not a folder"),
        (["--input", str(rows), "--output", str(a_file / "sub")], "is a file, not a folder"),
    ):
        code, _, stderr = run("submit", "--model", "mlp", *arguments, "--url", url)
        assert code == 1 and message in stderr, stderr
        assert "Traceback" not in stderr
    code, _, stderr = run("download", "0" * 32, "--output", str(a_file), "--url", url)
    assert code == 1 and "is a file, not a folder" in stderr
    code, _, stderr = run("upload", str(tmp_path / "nope.npy"), "--url", url)
    assert code == 1 and "no such file" in stderr
    assert fake.requests == []


def test_a_failed_job_shows_its_reason_first_and_no_empty_rows(rows: Path, tmp_path: Path) -> None:
    reason = "input 'upload:x': rows of shape [15] do not fit input 'input' [16]"
    with fake_gateway(FakeGateway(fail_with=reason)) as (url, fake):
        code, stdout, stderr = run(
            "submit", "--model", "mlp", "--input", str(rows), "--output", str(tmp_path / "o"),
            "--url", url,
        )  # fmt: skip
    assert code == 1
    lines = stdout.splitlines()
    assert "failed" in lines[1] and reason in lines[2], stdout
    assert "rows 0" not in stdout and "0/?" not in stdout + stderr
    assert not (tmp_path / "o").exists() and fake.count("GET", "/v2/batches/") > 0
    assert all("/outputs" not in path for _, path, _ in fake.requests)
    # What the job committed stays on the server: the command says how to fetch it.
    batch_id = lines[0].split()[1]
    assert f"sluice batch download {batch_id} --output {tmp_path / 'o'}" in stdout


def test_no_download_leaves_the_results_on_the_server(
    gateway: tuple[str, FakeGateway], rows: Path, tmp_path: Path
) -> None:
    url, _ = gateway
    out = tmp_path / "out"
    code, stdout, _ = run(
        "submit", "--model", "mlp", "--input", str(rows), "--output", str(out), "--no-download",
        "--url", url,
    )  # fmt: skip
    assert code == 0 and not out.exists()
    batch_id = stdout.split()[1]
    assert f"sluice batch download {batch_id} --output {out}" in stdout
    code, stdout, stderr = run("download", batch_id, "--output", str(out), "--url", url)
    assert code == 0, stderr
    assert (out / "output.bin").read_bytes() == DATA[::-1]


@pytest.mark.parametrize(
    ("fault", "message"),
    [
        ({"corrupt": True}, "sha256 differs"),
        ({"corrupt": True, "list_sha256": False, "cut_after": 1000}, "cannot reach"),
        ({"extra_names": ["../escape"]}, "not a plain file name"),
        ({"extra_names": ["/etc/passwd"]}, "not a plain file name"),
        ({"extra_names": [".hidden"]}, "not a plain file name"),
    ],
)
@pytest.mark.slow
def test_a_bad_download_leaves_no_file_under_its_name(
    rows: Path, tmp_path: Path, fault: dict[str, object], message: str
) -> None:
    with fake_gateway() as (url, fake):
        with Client(url, retries=0) as client:
            batch_id = client.submit_batch("mlp", "upload:" + client.upload(rows)["id"])["id"]
            client.wait_batch(batch_id, poll_s=0.01)
        for name, value in fault.items():
            setattr(fake, name, value)
        out = tmp_path / "out"
        code, _, stderr = run("download", batch_id, "--output", str(out), "--url", url)
    assert code == 1 and message in stderr, stderr
    assert not (out / "output.bin").exists() and leftovers(tmp_path) == []
    assert not (tmp_path / "escape").exists()


def test_a_full_quota_is_told_and_not_retried(rows: Path) -> None:
    with fake_gateway(FakeGateway(quota_full=True)) as (url, fake):
        code, _, stderr = run("submit", "--model", "mlp", "--input", str(rows), "--url", url)
        assert fake.count("POST", "/v2/uploads") == 1
        with Client(url) as client, pytest.raises(QuotaExceeded) as info:
            client.upload(rows)
        assert info.value.retry_after_s == 60 and fake.count("POST", "/v2/uploads") == 2
    assert code == 1 and "SLUICE_TENANT_MAX_STORED_BYTES" in stderr
    assert fake.submitted == []


def test_upload_and_uploads(gateway: tuple[str, FakeGateway], rows: Path) -> None:
    url, fake = gateway
    code, stdout, stderr = run("upload", str(rows), "--url", url)
    assert code == 0, stderr
    (upload_id,) = fake.uploads
    assert stdout.strip() == f"upload:{upload_id}"
    code, stdout, _ = run("uploads", "--url", url)
    assert code == 0 and upload_id[:8] in stdout and "rows.npy" in stdout


def test_a_file_that_changes_size_while_uploaded_is_not_sent_as_it_was(
    gateway: tuple[str, FakeGateway], rows: Path
) -> None:
    url, fake = gateway

    def grow(done: int, total: int | None) -> None:
        if done == 0:  # hashed already, not sent yet
            with rows.open("ab") as handle:
                handle.write(b"more")

    with Client(url, retries=0) as client, pytest.raises(OSError, match="changed while"):
        client.upload(rows, progress=grow)

    def shrink(done: int, total: int | None) -> None:
        if done:  # the first chunk is on its way
            rows.write_bytes(b"")

    with Client(url, retries=0) as client, pytest.raises(OSError, match="changed while"):
        client.upload(rows, progress=shrink)
    assert fake.uploads == {}


def test_the_client_runs_a_batch_end_to_end(
    gateway: tuple[str, FakeGateway], rows: Path, tmp_path: Path
) -> None:
    url, fake = gateway
    seen: list[tuple[int, int | None]] = []
    with Client(url) as client:
        record = client.upload(rows, name="data set.npy", progress=lambda *p: seen.append(p))
        assert record["name"] == "data set.npy"
        assert seen[0] == (0, len(DATA)) and seen[-1] == (len(DATA), len(DATA))
        state = client.run_batch("mlp", rows, tmp_path / "out", poll_s=0.01, shard_rows=10)
        assert state["status"] == "completed"
        assert fake.submitted[-1]["options"] == {"shard_rows": 10}
        files = client.batch_outputs(state["id"])
        assert {item["name"] for item in files} == {"output.bin", "_manifest.json"}
    assert (tmp_path / "out" / "output.bin").read_bytes() == DATA[::-1]
    fake.fail_with = "the model is broken"
    with Client(url) as client, pytest.raises(BatchFailed, match="the model is broken"):
        client.run_batch("mlp", rows, tmp_path / "out2", poll_s=0.01)


async def test_the_async_client_uploads_and_downloads(
    gateway: tuple[str, FakeGateway], rows: Path, tmp_path: Path
) -> None:
    url, fake = gateway
    seen: list[tuple[int, int | None]] = []
    async with AsyncClient(url) as client:
        state = await client.run_batch("mlp", rows, tmp_path / "out", poll_s=0.01)
        assert state["status"] == "completed"
        saved = await client.download_batch_outputs(
            state["id"], tmp_path / "again", progress=lambda *p: seen.append(p)
        )
        assert sorted(path.name for path in saved) == ["_manifest.json", "output.bin"]
        fake.corrupt = True
        with pytest.raises(MalformedResponse, match="sha256 differs"):
            await client.download_batch_output(
                state["id"],
                "output.bin",
                tmp_path / "bad.bin",
                sha256=hashlib.sha256(DATA[::-1]).hexdigest(),
            )
    assert (tmp_path / "out" / "output.bin").read_bytes() == DATA[::-1]
    assert (tmp_path / "again" / "output.bin").read_bytes() == DATA[::-1]
    assert seen[-1][0] == seen[-1][1] == sum(path.stat().st_size for path in saved)
    assert not (tmp_path / "bad.bin").exists() and leftovers(tmp_path) == []


def test_sluice_infer_and_routing_take_sluice_url_too(
    gateway: tuple[str, FakeGateway], tmp_path: Path
) -> None:
    url, fake = gateway
    np.save(tmp_path / "x.npy", np.ones((1, 2), dtype=np.float32))
    runner = CliRunner()
    runner.invoke(
        app, ["infer", "m", "--input", f"x={tmp_path / 'x.npy'}"], env={"SLUICE_URL": url}
    )
    runner.invoke(app, ["routing", "show", "m"], env={"SLUICE_URL": url})
    paths = [path for _, path, _ in fake.requests]
    assert paths == ["/v2/models/m/infer", "/v2/repository/models/m/routing"]


def test_a_job_waiting_for_a_turn_shows_its_place() -> None:
    """A tenant's jobs beyond SLUICE_TENANT_MAX_RUNNING_BATCHES wait queued, in line."""
    waiting = {"id": "b" * 32, "model": "mlp", "status": "queued", "place": 2, "polls": 0}
    with fake_gateway(FakeGateway(polls_before_rows=10)) as (url, fake):
        fake.batches[waiting["id"]] = waiting
        code, stdout, _ = run("status", "b" * 32, "--url", url)
    assert code == 0
    assert "queued" in stdout and "waiting for a turn: 2 in line (1: next)" in stdout, stdout
