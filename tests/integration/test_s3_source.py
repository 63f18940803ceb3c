"""s3:// repositories against a real S3 HTTP server (moto's, on a loopback port), with boto3
on both sides: what is uploaded completely is served, what is half uploaded is not, changes
show at the next poll, hostile keys and oversized objects are refused, failures say what
failed, and ``sluice up --model-repository s3://...`` serves a model from the bucket."""

from __future__ import annotations

import logging
import socket
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import boto3
import httpx
import pytest
from redis import Redis

from sluice.core.keys import Keys
from sluice.core.repository import scan_repository
from sluice.core.settings import RepositorySourceSettings
from sluice.scheduler.executor.redis_server import free_port
from sluice.scheduler.repository.listing import MANIFEST_NAME, build_manifest
from sluice.scheduler.repository.locations import open_source, snapshot_repository
from sluice.scheduler.repository.sources import SourceError, poll
from tests.support.gateway_refresh import wait_for_refresh
from tests.support.onnx_models import write_identity
from tests.support.procs import wait_until
from tests.support.stack import Stack

CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "sluice-test",
    "AWS_SECRET_ACCESS_KEY": "sluice-test-secret",
    "AWS_DEFAULT_REGION": "us-east-1",
}


@pytest.fixture(autouse=True)
def aws_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Test credentials, and nothing from the machine's own AWS configuration."""
    for name, value in CREDENTIALS.items():
        monkeypatch.setenv(name, value)
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


@pytest.fixture
def s3(s3_endpoint: str) -> Any:
    return boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1")


@pytest.fixture
def bucket(s3: Any) -> str:
    name = f"models-{uuid.uuid4().hex[:12]}"
    s3.create_bucket(Bucket=name)
    return name


def settings_for(endpoint: str, tmp_path: Path, **overrides: Any) -> RepositorySourceSettings:
    values: dict[str, Any] = {
        "s3_endpoint_url": endpoint,
        "repository_cache_dir": str(tmp_path / "cache"),
        "s3_timeout_s": 5.0,
        "s3_attempts": 2,
    }
    return RepositorySourceSettings(**(values | overrides))


def upload(s3: Any, bucket: str, prefix: str, model_dir: Path, *, manifest: bool = True) -> None:
    """Upload a local model folder as a careful uploader does: each version's manifest last."""
    name = model_dir.name
    for path in sorted(p for p in model_dir.rglob("*") if p.is_file()):
        key = f"{prefix}{name}/{path.relative_to(model_dir).as_posix()}"
        s3.put_object(Bucket=bucket, Key=key, Body=path.read_bytes())
    if manifest:
        for version in sorted(p for p in model_dir.iterdir() if p.name.isdigit()):
            put_manifest(s3, bucket, f"{prefix}{name}/{version.name}", version)


def put_manifest(s3: Any, bucket: str, folder: str, version_dir: Path) -> None:
    body = build_manifest(version_dir)
    s3.put_object(Bucket=bucket, Key=f"{folder}/{MANIFEST_NAME}", Body=body)


def add_version(model_dir: Path, version: int) -> Path:
    folder = model_dir / str(version)
    folder.mkdir()
    (folder / "model.onnx").write_bytes((model_dir / "1" / "model.onnx").read_bytes())
    return folder


def test_a_complete_upload_becomes_a_triton_repository(
    s3: Any, bucket: str, s3_endpoint: str, tmp_path: Path
) -> None:
    model = write_identity(tmp_path / "local", "ident", ["FP32"])
    (model / "labels.txt").write_text("a\nb\n")
    upload(s3, bucket, "repo/", model)
    root = snapshot_repository(f"s3://{bucket}/repo", settings_for(s3_endpoint, tmp_path))
    assert root.is_relative_to(tmp_path / "cache")
    (served,) = scan_repository(root)
    assert served.name == "ident" and served.usable and served.versions == (1,)
    for relative in ("config.pbtxt", "labels.txt", "1/model.onnx"):
        assert (root / "ident" / relative).read_bytes() == (model / relative).read_bytes()
    assert not (root / "ident" / "1" / MANIFEST_NAME).exists()


def test_a_half_uploaded_version_is_taken_once_complete(
    s3: Any, bucket: str, s3_endpoint: str, tmp_path: Path
) -> None:
    model = write_identity(tmp_path / "local", "ident", ["FP32"])
    upload(s3, bucket, "", model)
    source = open_source(f"s3://{bucket}", settings_for(s3_endpoint, tmp_path))
    listing, changes = poll(source, source.served())
    assert changes.appeared == (("ident", 1),)
    root = source.materialise(listing).root

    # Version 2: its files, but no manifest yet.
    upload(s3, bucket, "", add_version(model, 2).parent, manifest=False)
    listing, changes = poll(source, source.served())
    assert not changes
    assert "incomplete: no .sluice-manifest.json yet" in listing.models["ident"].not_taken[2]
    source.materialise(listing)
    assert not (root / "ident" / "2").exists()

    # Version 3 as `aws s3 sync` may upload it: the manifest before the model file.
    put_manifest(s3, bucket, "ident/3", add_version(model, 3))
    listing, changes = poll(source, source.served())
    assert not changes and "'s3://" in listing.models["ident"].not_taken[3]
    assert "ident/3/model.onnx' is missing" in listing.models["ident"].not_taken[3]

    # Completing both uploads makes them appear at the next poll.
    put_manifest(s3, bucket, "ident/2", model / "2")
    s3.put_object(
        Bucket=bucket, Key="ident/3/model.onnx", Body=(model / "3" / "model.onnx").read_bytes()
    )
    listing, changes = poll(source, source.served())
    assert changes.appeared == (("ident", 2), ("ident", 3))
    assert not source.materialise(listing).problems
    assert sorted(p.name for p in (root / "ident").iterdir() if p.is_dir()) == ["1", "2", "3"]
    assert not poll(source, source.served())[1]


def test_changed_objects_are_detected_and_taken_only_when_consistent(
    s3: Any, bucket: str, s3_endpoint: str, tmp_path: Path
) -> None:
    model = write_identity(tmp_path / "local", "ident", ["FP32"])
    upload(s3, bucket, "repo/", model)
    source = open_source(f"s3://{bucket}/repo/", settings_for(s3_endpoint, tmp_path))
    root = source.materialise(source.list()).root

    config = (model / "config.pbtxt").read_text() + "\n# changed\n"
    s3.put_object(Bucket=bucket, Key="repo/ident/config.pbtxt", Body=config.encode())
    listing, changes = poll(source, source.served())
    assert changes.changed == (("ident", 1),)
    source.materialise(listing)
    assert (root / "ident" / "config.pbtxt").read_text() == config

    # Same size, other bytes, the old manifest: listed as complete, refused on its checksum.
    original = (model / "1" / "model.onnx").read_bytes()
    tampered = original[:-1] + bytes([original[-1] ^ 1])
    s3.put_object(Bucket=bucket, Key="repo/ident/1/model.onnx", Body=tampered)
    listing, changes = poll(source, source.served())
    assert changes.changed == (("ident", 1),)
    problems = source.materialise(listing).problems
    assert "'s3://" in problems["ident"] and "repo/ident/1/model.onnx'" in problems["ident"]
    assert "does not match the manifest's sha256" in problems["ident"]
    assert (root / "ident" / "1" / "model.onnx").read_bytes() == original

    # Rewriting the manifest (the last step of an upload) makes the new file taken.
    (model / "1" / "model.onnx").write_bytes(tampered)
    put_manifest(s3, bucket, "repo/ident/1", model / "1")
    listing, _ = poll(source, source.served())
    assert not source.materialise(listing).problems
    assert (root / "ident" / "1" / "model.onnx").read_bytes() == tampered


def test_hostile_keys_are_refused_and_nothing_is_written_outside_the_cache(
    s3: Any, bucket: str, s3_endpoint: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    upload(s3, bucket, "repo/", write_identity(tmp_path / "local", "good", ["FP32"]))
    evil = write_identity(tmp_path / "local", "evil", ["FP32"])
    upload(s3, bucket, "repo/", evil)
    hostile = {
        "repo/evil/1/../../../../../escaped.txt": "'..'",
        "repo/bad\\name/1/model.onnx": "backslash",
        "repo//abs/1/model.onnx": "absolute",
        "repo/ctl/1/model\x01.onnx": "control character",
    }
    for key in hostile:
        s3.put_object(Bucket=bucket, Key=key, Body=b"escaped")
    caplog.set_level(logging.WARNING, logger="sluice.sources")
    root = snapshot_repository(f"s3://{bucket}/repo", settings_for(s3_endpoint, tmp_path))
    assert [m.name for m in scan_repository(root)] == ["good"]
    for key, reason in hostile.items():
        lines = [
            r.getMessage()
            for r in caplog.records
            if ascii(f"s3://{bucket}/{key}") in r.getMessage()
        ]
        assert lines and reason in lines[0], (key, caplog.text)
    assert "model 'evil' refused: refused key" in caplog.text
    assert not list(tmp_path.parent.rglob("escaped.txt"))


def test_limits_are_enforced(s3: Any, bucket: str, s3_endpoint: str, tmp_path: Path) -> None:
    model = write_identity(tmp_path / "local", "ident", ["FP32"])
    (model / "1" / "weights.bin").write_bytes(b"w" * 10_000)
    upload(s3, bucket, "", model)
    small = settings_for(s3_endpoint, tmp_path, s3_max_object_bytes=9_999)
    listing = open_source(f"s3://{bucket}", small).list()
    reason = listing.models["ident"].not_taken[1]
    assert f"'s3://{bucket}/ident/1/weights.bin' is 10000 bytes, over the limit of 9999" in reason

    total = sum(p.stat().st_size for p in model.rglob("*") if p.is_file())
    tight = settings_for(s3_endpoint, tmp_path, s3_max_version_bytes=total - 1)
    listing = open_source(f"s3://{bucket}", tight).list()
    assert f"{total} bytes with the model's own files" in listing.models["ident"].not_taken[1]
    assert "SLUICE_S3_MAX_VERSION_BYTES" in listing.models["ident"].not_taken[1]
    root = open_source(f"s3://{bucket}", tight).materialise(listing).root
    assert not (root / "ident").exists()

    few = settings_for(s3_endpoint, tmp_path, s3_max_objects=2)
    with pytest.raises(SourceError, match="more than 2 objects under the prefix"):
        open_source(f"s3://{bucket}", few).list()


def test_store_failures_are_clear_errors(s3_endpoint: str, tmp_path: Path) -> None:
    with pytest.raises(SourceError, match="the bucket 'no-such-bucket' does not exist"):
        open_source("s3://no-such-bucket/m", settings_for(s3_endpoint, tmp_path)).list()

    closed = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(SourceError, match="cannot reach the store"):
        open_source("s3://bkt/m", settings_for(closed, tmp_path, s3_timeout_s=1.0)).list()

    with socket.create_server(("127.0.0.1", 0)) as silent:  # accepts, never answers
        endpoint = f"http://127.0.0.1:{silent.getsockname()[1]}"
        settings = settings_for(endpoint, tmp_path, s3_timeout_s=0.5, s3_attempts=2)
        with pytest.raises(SourceError) as caught:
            open_source("s3://bkt/m", settings).list()
    assert "listing s3://bkt/m/: no answer from the store within 0.5 s (2 attempt(s)" in (
        caught.value.message
    )


def test_sluice_up_serves_a_model_from_the_bucket(
    s3: Any,
    bucket: str,
    s3_endpoint: str,
    tmp_path: Path,
    start_stack: Callable[..., Stack],
) -> None:
    upload(s3, bucket, "models/", write_identity(tmp_path / "local", "ident", ["FP32"]))
    s3.put_object(Bucket=bucket, Key="models/partial/1/model.onnx", Body=b"half")
    env = CREDENTIALS | {
        "SLUICE_S3_ENDPOINT_URL": s3_endpoint,
        "SLUICE_REPOSITORY_CACHE_DIR": str(tmp_path / "cache"),
        "AWS_CONFIG_FILE": str(tmp_path / "no-aws-config"),
        "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "no-aws-credentials"),
    }
    stack = start_stack(f"s3://{bucket}/models", env=env)
    body = {"inputs": [{"name": "IN_FP32", "shape": [2, 1], "datatype": "FP32", "data": [1.5, -2]}]}
    with httpx.Client(base_url=stack.url, timeout=10) as http:
        response = http.post("/v2/models/ident/infer", json=body)
        assert response.status_code == 200, response.text
        assert response.json()["outputs"][0]["data"] == [1.5, -2]
        names = [row["name"] for row in http.post("/v2/repository/index").json()]
    assert names == ["ident"]  # the half-uploaded model is not served
    assert "model 'partial' version 1 not taken: incomplete" in "".join(stack.stderr_lines)
    assert stack.stop() == 0


def test_a_new_version_uploaded_to_the_bucket_is_rolled_out_once_complete(
    s3: Any, bucket: str, s3_endpoint: str, tmp_path: Path, redis_server: Any
) -> None:
    """The whole story: version 2 of a model is uploaded while version 1 serves under load.
    Its files alone change nothing; once its manifest lands, ``sluice up`` (poll mode) takes
    it, loads and warms it beside version 1, gives it a share of the traffic, and promotes
    it, with no failed request."""
    canary = """
    parameters { key: "sluice.rollout" value { string_value: "canary" } }
    parameters { key: "sluice.rollout_steps" value { string_value: "50" } }
    parameters { key: "sluice.rollout_step_s" value { string_value: "1" } }
    parameters { key: "sluice.rollout_min_samples" value { string_value: "10" } }
    parameters { key: "sluice.rollout_min_p99_increase_s" value { string_value: "0.5" } }
    """
    local = write_identity(tmp_path / "local", "ident", ["FP32"], extra=canary)
    upload(s3, bucket, "models/", local)
    env = CREDENTIALS | {
        "SLUICE_S3_ENDPOINT_URL": s3_endpoint,
        "SLUICE_REPOSITORY_CACHE_DIR": str(tmp_path / "cache"),
        "SLUICE_REPOSITORY_POLL_S": "0.5",
        "AWS_CONFIG_FILE": str(tmp_path / "no-aws-config"),
        "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "no-aws-credentials"),
    }
    stack = Stack(
        f"s3://{bucket}/models",
        redis_server.url,
        env=env,
        args=["--model-control-mode", "poll"],
    )
    stack.start()
    codes: list[int] = []
    versions: list[str] = []
    stop = threading.Event()

    def steady() -> None:
        body = {"inputs": [{"name": "IN_FP32", "shape": [1, 1], "datatype": "FP32", "data": [1]}]}
        with httpx.Client(base_url=stack.url, timeout=30) as http:
            while not stop.is_set():
                answer = http.post("/v2/models/ident/infer", json=body)
                if answer.status_code == 200:
                    versions.append(answer.json()["model_version"])
                codes.append(answer.status_code)

    load = threading.Thread(target=steady)
    load.start()
    try:
        version_dir = add_version(local, 2)
        key = "models/ident/2/model.onnx"
        s3.put_object(Bucket=bucket, Key=key, Body=(version_dir / "model.onnx").read_bytes())
        time.sleep(2.0)  # several polls: the version has no manifest yet
        assert set(versions) == {"1"}
        rollout_url = f"{stack.url}/v2/repository/models/ident/rollout"
        assert httpx.get(rollout_url).status_code == 404
        put_manifest(s3, bucket, "models/ident/2", version_dir)  # the upload completes

        def promoted() -> bool:
            answer = httpx.get(rollout_url)
            return answer.status_code == 200 and answer.json()["phase"] == "promoted"

        assert wait_until(promoted, 60), httpx.get(rollout_url).text
        # The gateway routes by what it read at its refresh: once it has refreshed since,
        # a request sent after that goes to version 2 alone.
        with Redis.from_url(redis_server.url) as redis:
            assert wait_for_refresh(redis, Keys(stack.namespace)), "the gateway did not refresh"
        sent_after = len(codes) + 2
        assert wait_until(lambda: len(codes) >= sent_after, 30), "no answer since"
    finally:
        stop.set()
        load.join(30)
        stack.stop()
    assert set(codes) == {200}, f"{len(codes) - codes.count(200)} of {len(codes)} failed"
    assert versions[0] == "1" and versions[-1] == "2" and "2" in versions
