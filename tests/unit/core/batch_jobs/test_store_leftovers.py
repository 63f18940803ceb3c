"""What a writer that died leaves in the batch store is removed with the file it was
writing: a local partial file (hidden beside its place), or on S3 the multipart upload it
had started, which no listing of objects shows and S3 keeps (and bills) until it is
aborted. The store sweepers remove them with an upload a gateway died in the middle of, and
with an expired batch job's outputs."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest
from moto import mock_aws

from sluice.core.batch_jobs.store import S3_PART_BYTES, LocalTree, S3Tree


@pytest.fixture
def s3() -> Iterator[Any]:
    with mock_aws():
        client = boto3.client("s3", region_name="us-east-1")
        client.create_bucket(Bucket="batches")
        yield client


def _uploads(client: Any) -> list[str]:
    return [u["Key"] for u in client.list_multipart_uploads(Bucket="batches").get("Uploads", [])]


def test_s3_discard_and_delete_tree_abort_what_dead_writers_started(s3: Any) -> None:
    tree = S3Tree(s3, "batches", "store", "store")
    uploads = tree.child("team-a/uploads")
    outputs = tree.child("team-a/batches/" + "b" * 32)
    for area, key in ((uploads, "u" * 32), (outputs, "part-000000-a1.output.npy")):
        writer = area.writer(key)
        writer.write(b"\0" * (S3_PART_BYTES + 1))  # one part sent; then its process died
    assert len(_uploads(s3)) == 2
    uploads.writer("v" * 32).write(b"\0" * (S3_PART_BYTES + 1))  # another upload's: kept
    kept = "store/team-a/uploads/" + "v" * 32
    uploads.discard("u" * 32)
    assert set(_uploads(s3)) == {
        kept,
        "store/team-a/batches/" + "b" * 32 + "/part-000000-a1.output.npy",
    }
    outputs.delete_tree()
    assert _uploads(s3) == [kept]


def test_local_discard_removes_a_dead_writers_partial_file(tmp_path: Path) -> None:
    tree = LocalTree(tmp_path, "store")
    writer = tree.writer("u" * 32)
    writer.write(b"\0" * 100)
    dead = next(tmp_path.iterdir())  # as its process, killed, left it (neither committed
    writer.abort()  # nor aborted): made again below, beside another upload's partial file
    dead.write_bytes(b"\0" * 100)
    (tmp_path / f".{'v' * 32}.0123abcd.part").write_bytes(b"\0" * 100)
    tree.discard("u" * 32)
    left = sorted(p.name for p in tmp_path.iterdir())
    assert len(left) == 1 and left[0].startswith("." + "v" * 32)
