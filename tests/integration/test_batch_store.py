"""The batch store and the location policy on real parts: real files and links, moto's S3
server over HTTP, a real Redis for the runner's join."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import boto3
import numpy as np
import pytest

from sluice.batch.runner import Runner
from sluice.core.batch_jobs.access import LocationPolicy
from sluice.core.batch_jobs.store import LocalTree, S3Clients, open_tree
from sluice.core.errors import Forbidden, InvalidInput, PayloadTooLarge
from sluice.core.settings import BatchSettings, BatchStoreSettings
from sluice.scheduler.executor.redis_server import RedisServer

CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "sluice-test",
    "AWS_SECRET_ACCESS_KEY": "sluice-test-secret",
    "AWS_DEFAULT_REGION": "us-east-1",
}


def policy(**settings: str) -> LocationPolicy:
    return LocationPolicy.from_settings(BatchStoreSettings(**settings))  # type: ignore[arg-type]


def refused(rules: LocationPolicy, tenant: str, location: str) -> str:
    with pytest.raises(Forbidden) as caught:
        rules.check(tenant, location, "output")
    return caught.value.message.replace(location, "<location>")


def test_the_model_repository_inside_the_batch_root_stays_out_of_reach(tmp_path: Path) -> None:
    """Defect 2: the old `sluice up` made its start directory, which holds the repository,
    the batch root."""
    repository = tmp_path / "model_repository"
    (repository / "iris" / "1").mkdir(parents=True)
    (tmp_path / "link").symlink_to(repository / "iris")
    rules = policy(batch_root=str(tmp_path), model_repository=str(repository))
    assert rules.check("a", str(tmp_path / "out"), "output") == str(tmp_path / "out")
    words = {
        refused(rules, "a", str(repository / "iris" / "7")),
        refused(rules, "a", str(tmp_path / "link" / "7")),
        refused(rules, "a", str(repository / "missing" / "x")),
        refused(rules, "a", "/nowhere/at/all"),
    }
    assert len(words) == 1, words  # exists or not, allowed or forbidden: the same words
    assert str(tmp_path) not in words.pop()


def test_every_repository_of_several_stays_out_of_reach(tmp_path: Path) -> None:
    repositories = [str(tmp_path / "first"), "s3://models/second"]
    rules = policy(
        batch_allowed_locations=r"*=/.*,*=s3://.*",
        model_repository=json.dumps(repositories),
        repository_cache_dir=str(tmp_path / "cache"),
    )
    assert rules.check("a", str(tmp_path / "out"), "output") == str(tmp_path / "out")
    for location in (
        str(tmp_path / "first" / "iris" / "1" / "model.onnx"),
        "s3://models/second/iris/1/model.onnx",
        str(tmp_path / "cache" / "view-0123456789abcdef" / "iris"),
    ):
        refused(rules, "a", location)


def test_rules_are_per_tenant_and_never_open_forbidden_areas(tmp_path: Path) -> None:
    store = tmp_path / "store"
    rules = policy(
        batch_allowed_locations=r"team-a=s3://a-data/.*,*=/.*,*=s3://.*",
        batch_store=str(store),
        model_repository="s3://models/repo",
        repository_cache_dir=str(tmp_path / "cache"),
    )
    assert rules.check("team-a", "s3://a-data/x.npy", "input") == "s3://a-data/x.npy"
    assert rules.check("team-a", str(store / "team-a" / "x"), "output")
    for tenant, location in (
        ("team-a", "s3://models/repo/iris/1/model.onnx"),
        ("team-a", str(store / "team-b" / "uploads" / "x")),
        ("team-a", str(store / "x")),
        ("team-a", f"{sys.prefix}/lib/x.npy"),
        ("team-a", str(tmp_path / "cache" / "x")),
    ):
        refused(rules, tenant, location)
    assert rules.check("team-b", "s3://models/other/x", "input")  # beside the repository
    narrow = policy(batch_allowed_locations=r"team-a=s3://a-data/.*")
    refused(narrow, "team-b", "s3://a-data/x.npy")
    refused(narrow, "team-a", "s3://a-data-2/x.npy")


def test_the_join_never_unpickles_a_part(tmp_path: Path, redis_server: RedisServer) -> None:
    """Defect 9: a part replaced with a pickled object array is refused, not loaded."""
    runner = Runner(
        BatchSettings(redis_url=redis_server.url, namespace="join-test"), lambda *_: None
    )
    try:
        tree = LocalTree(tmp_path, "/out")
        np.save(tmp_path / "part-0.npy", np.array([object(), 1], dtype=object), allow_pickle=True)
        parts = [{"rows": [0, 2], "files": {"output": "part-0.npy"}}]
        record = {"output": "/out", "owner": "a"}
        with pytest.raises(ValueError):  # refused before anything is unpickled
            runner._join("0" * 32, record, tree, parts, 2)
        np.save(tmp_path / "part-0.npy", np.array([b"x", b"y"], dtype=object), allow_pickle=True)
        with pytest.raises((ValueError, InvalidInput)):
            runner._join("0" * 32, record, tree, parts, 2)
        assert not (tmp_path / "output.npy").exists()
    finally:
        runner.close()


@pytest.fixture
def s3(s3_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[S3Clients]:
    for name, value in CREDENTIALS.items():
        monkeypatch.setenv(name, value)
    settings = BatchStoreSettings(s3_endpoint_url=s3_endpoint, s3_region="us-east-1")
    yield S3Clients(settings)


def test_an_s3_store_streams_in_parts_and_leaves_nothing_when_aborted(
    s3: S3Clients, tmp_path: Path
) -> None:
    s3().create_bucket(Bucket="store")
    tree = open_tree("s3://store/prefix", s3, "store").child("team-a/uploads", "upload:")
    data = np.random.default_rng(1).bytes(19 << 20)
    writer = tree.writer("f" * 32)
    for start in range(0, len(data), 1 << 20):
        writer.write(data[start : start + (1 << 20)])
    writer.commit()
    assert tree.size("f" * 32) == len(data)
    assert b"".join(tree.read_chunks("f" * 32, len(data))) == data
    aborted = tree.writer("e" * 32)
    aborted.write(data)
    aborted.abort()
    assert tree.size("e" * 32) is None
    listed = boto3.client("s3", endpoint_url=s3.settings.s3_endpoint_url).list_objects_v2(
        Bucket="store"
    )
    assert [o["Key"] for o in listed["Contents"]] == [f"prefix/team-a/uploads/{'f' * 32}"]
    with pytest.raises(PayloadTooLarge, match="SLUICE_MAX_BATCH_INPUT_BYTES"):
        tree.fetch("f" * 32, tmp_path / "in.npy", len(data) - 1, "input")
    assert list(tmp_path.iterdir()) == []
    assert tree.fetch("f" * 32, tmp_path / "in.npy", len(data), "input").read_bytes() == data
    with pytest.raises(InvalidInput) as missing:
        tree.fetch("d" * 32, tmp_path / "x.npy", 10, "input")
    assert "prefix" not in missing.value.message and "upload:" in missing.value.message
