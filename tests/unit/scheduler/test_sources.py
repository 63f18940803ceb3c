"""Repository sources without a store: key checks, completeness, diffing, the cache's atomic
switch and its defences, the local source, and an S3 source against a stub client that
misbehaves as a hostile or broken store would."""

from __future__ import annotations

import hashlib
import io
import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
from botocore.exceptions import ReadTimeoutError

from sluice.core.repository import scan_repository
from sluice.core.settings import RepositorySourceSettings
from sluice.scheduler.repository.cache import Sink, SnapshotCache
from sluice.scheduler.repository.listing import (
    MANIFEST_NAME,
    Limits,
    RemoteObject,
    assemble,
    build_manifest,
    parse_manifest,
)
from sluice.scheduler.repository.local import LocalSource
from sluice.scheduler.repository.locations import open_source, snapshot_repository
from sluice.scheduler.repository.s3 import S3Source, parse_s3_url
from sluice.scheduler.repository.sources import (
    Entry,
    Listing,
    SourceError,
    carry_over,
    diff,
    key_problem,
    poll,
)
from tests.support.onnx_models import write_identity

LIMITS = Limits(max_object_bytes=1 << 20, max_version_bytes=4 << 20)


class FakeStore:
    """A flat object store in memory: ``{relative key: bytes}``, ETags from the content."""

    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}
        self.fetched: list[str] = []

    def put(self, key: str, data: bytes) -> None:
        self.objects[key] = data

    def put_model(self, local: Path, name: str, *, manifest: bool = True) -> None:
        """Upload a local model folder as ``name/...``, each version's manifest last."""
        for path in sorted(p for p in local.rglob("*") if p.is_file()):
            self.put(f"{name}/{path.relative_to(local).as_posix()}", path.read_bytes())
        if manifest:
            for version in (p for p in local.iterdir() if p.is_dir() and p.name.isdigit()):
                self.put(f"{name}/{version.name}/{MANIFEST_NAME}", build_manifest(version))

    def put_manifest(self, name: str, version: int, files: dict[str, bytes]) -> None:
        entries = {
            path: {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
            for path, data in files.items()
        }
        document = {"sluice_manifest": 1, "files": entries}
        self.put(f"{name}/{version}/{MANIFEST_NAME}", json.dumps(document).encode())

    def listing(self, limits: Limits = LIMITS) -> Listing:
        objects = [
            RemoteObject(key, len(data), '"' + hashlib.md5(data).hexdigest() + '"')
            for key, data in sorted(self.objects.items())
        ]
        return assemble(objects, lambda obj: self.objects[obj.path], limits, self.where)

    @staticmethod
    def where(path: str) -> str:
        return f"s3://bucket/repo/{path}"

    def fetch(self, model: str, entry: Entry, sink: Sink) -> None:
        self.fetched.append(f"{model}/{entry.path}")
        sink.write(self.objects[f"{model}/{entry.path}"])


def version_files(name: str, version: int = 1, **files: bytes) -> dict[str, bytes]:
    return {f"{name}/{version}/{path}": data for path, data in files.items()}


# --- keys ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("key", "reason"),
    [
        ("m/1/../../../etc/passwd", "'..'"),
        ("m/./1/model.onnx", "'.'"),
        ("/etc/passwd", "absolute"),
        ("m/1\\..\\..\\x", "backslash"),
        ("m/1/model\x00.onnx", "NUL"),
        ("m/1/model\n.onnx", "control character"),
        ("m//1/model.onnx", "empty path component"),
        ("m/1/", "empty path component"),
        ("", "empty"),
        ("m/" + "x" * 256, "longer than 255"),
        ("/".join(["d"] * 17), "deeper"),
        ("/".join(["x" * 200] * 6), "longer than 1024"),
        ("m/1/\udcff", "UTF-8"),
    ],
)
def test_hostile_keys_are_refused_with_the_reason(key: str, reason: str) -> None:
    problem = key_problem(key)
    assert problem is not None and reason in problem


@pytest.mark.parametrize(
    "key", ["m/config.pbtxt", "m/1/model.onnx", "m/1/sub dir/é.bin", "m/..hidden/x", "m/a..b"]
)
def test_ordinary_keys_pass(key: str) -> None:
    assert key_problem(key) is None


def test_a_hostile_key_refuses_its_model_by_name_and_leaves_the_others(tmp_path: Path) -> None:
    store = FakeStore()
    store.put_model(write_identity(tmp_path, "good", ["FP32"]), "good")
    store.put_model(write_identity(tmp_path, "evil", ["FP32"]), "evil")
    store.put("evil/1/../../../../outside", b"x")
    store.put("..\\escape/1/model.onnx", b"x")
    store.put("/abs/1/model.onnx", b"x")
    listing = store.listing()
    assert list(listing.models) == ["good"]
    assert set(listing.refused) == {"evil"}
    assert "'s3://bucket/repo/evil/1/../../../../outside'" in listing.refused["evil"]
    assert "'..'" in listing.refused["evil"]
    assert any("backslash" in line and "escape" in line for line in listing.ignored)
    assert any("absolute" in line for line in listing.ignored)
    problems = listing.problems()
    assert any(line.startswith("model 'evil' refused: refused key") for line in problems)


def test_reserved_names_and_file_folder_clashes_refuse_the_model() -> None:
    store = FakeStore()
    store.put("a/config.pbtxt", b"")
    store.put("a/.sluice-snapshot.json", b"{}")
    store.put("b/1/x", b"1")
    store.put("b/1/x/y", b"2")
    listing = store.listing()
    assert "reserved" in listing.refused["a"]
    assert "'s3://bucket/repo/b/1/x' is both a file and a folder" in listing.refused["b"]


# --- completeness -------------------------------------------------------------------------


def test_a_version_is_taken_only_with_a_manifest_matching_its_objects() -> None:
    store = FakeStore()
    store.put("m/config.pbtxt", b"name: 'm'")
    store.objects.update(version_files("m", 1, **{"model.onnx": b"one"}))
    store.objects.update(version_files("m", 2, **{"model.onnx": b"two", "extra.bin": b"e"}))
    store.objects.update(version_files("m", 3, **{"model.onnx": b"three"}))
    store.put_manifest("m", 1, {"model.onnx": b"one"})
    store.put_manifest("m", 2, {"model.onnx": b"two"})  # extra.bin arrived after the manifest
    store.put_manifest("m", 3, {"model.onnx": b"three", "weights.bin": b"w"})  # not there yet
    store.objects.update(version_files("m", 4, **{"model.onnx": b"four"}))  # no manifest
    model = store.listing().models["m"]
    assert list(model.versions) == [1]
    assert [e.path for e in model.versions[1].entries] == ["1/model.onnx"]
    assert model.versions[1].entries[0].sha256 == hashlib.sha256(b"one").hexdigest()
    assert "'s3://bucket/repo/m/2/extra.bin' is not in the manifest" in model.not_taken[2]
    assert "'s3://bucket/repo/m/3/weights.bin' is missing" in model.not_taken[3]
    assert f"no {MANIFEST_NAME} yet" in model.not_taken[4]
    assert [e.path for e in model.shared] == ["config.pbtxt"]


def test_a_file_of_another_size_than_the_manifest_says_is_not_complete() -> None:
    store = FakeStore()
    store.objects.update(version_files("m", 1, **{"model.onnx": b"partial"}))
    store.put_manifest("m", 1, {"model.onnx": b"partial upload, longer"})
    assert "not the size the manifest says" in store.listing().models["m"].not_taken[1]


def _manifest(path: str, size: int, sha256: str) -> bytes:
    files = {path: {"size": size, "sha256": sha256}}
    return json.dumps({"sluice_manifest": 1, "files": files}).encode()


@pytest.mark.parametrize(
    ("manifest", "reason"),
    [
        (b"not json", "invalid JSON"),
        (b'{"files": {}}', "sluice_manifest"),
        (b'{"sluice_manifest": 1, "files": []}', '"files" is not an object'),
        (_manifest("../x", 1, "0" * 64), "'..'"),
        (_manifest("x", -1, "0" * 64), "size"),
        (b'{"sluice_manifest": 1, "files": {"x": {"size": 1, "sha256": "abc"}}}', "sha256"),
    ],
)
def test_bad_manifests_are_refused_with_the_reason(manifest: bytes, reason: str) -> None:
    with pytest.raises(SourceError) as caught:
        parse_manifest(manifest, "'s3://b/m/1/.sluice-manifest.json'")
    assert "'s3://b/m/1/.sluice-manifest.json': not a usable manifest" in caught.value.message
    assert reason in caught.value.message


def test_limits_per_object_and_per_version() -> None:
    store = FakeStore()
    store.objects.update(version_files("m", 1, **{"model.onnx": b"x" * 2000}))
    store.put_manifest("m", 1, {"model.onnx": b"x" * 2000})
    store.objects.update(version_files("m", 2, **{"a": b"x" * 600, "b": b"x" * 600}))
    store.put_manifest("m", 2, {"a": b"x" * 600, "b": b"x" * 600})
    store.objects.update(version_files("m", 3, **{"a": b"x" * 10}))
    store.put_manifest("m", 3, {"a": b"x" * 10})
    store.put("big/config.pbtxt", b"x" * 2000)
    listing = store.listing(Limits(max_object_bytes=1000, max_version_bytes=1000))
    model = listing.models["m"]
    assert list(model.versions) == [3]
    assert (
        "'s3://bucket/repo/m/1/model.onnx' is 2000 bytes, over the limit of 1000"
        in (model.not_taken[1])
    )
    assert "SLUICE_S3_MAX_OBJECT_BYTES" in model.not_taken[1]
    assert (
        "1200 bytes" in model.not_taken[2] and "SLUICE_S3_MAX_VERSION_BYTES" in model.not_taken[2]
    )
    assert "SLUICE_S3_MAX_OBJECT_BYTES" in listing.refused["big"]


def test_non_version_folders_placeholders_and_hidden_models_are_left_alone() -> None:
    store = FakeStore()
    store.put("m/", b"")
    store.put("m/0/model.onnx", b"zero")  # Triton ignores 0/ and 01/ as well
    store.put("m/01/model.onnx", b"zero")
    store.put("m/warmup/input", b"w")
    store.put(".hidden/1/model.onnx", b"h")
    store.put("README", b"not a model")
    listing = store.listing()
    assert list(listing.models) == ["m"]
    assert [e.path for e in listing.models["m"].shared] == ["warmup/input"]
    assert not listing.models["m"].versions and not listing.refused and not listing.ignored


# --- diffing ------------------------------------------------------------------------------


def _complete_store() -> FakeStore:
    store = FakeStore()
    store.put("m/config.pbtxt", b"config 1")
    for version in (1, 2):
        store.objects.update(version_files("m", version, **{"model.onnx": b"v%d" % version}))
        store.put_manifest("m", version, {"model.onnx": b"v%d" % version})
    store.objects.update(version_files("gone", 1, **{"model.onnx": b"g"}))
    store.put_manifest("gone", 1, {"model.onnx": b"g"})
    return store


def test_diff_says_what_appeared_changed_and_disappeared() -> None:
    store = _complete_store()
    before = store.listing()
    assert not diff(before, store.listing())
    store.put("m/2/model.onnx", b"V2")
    store.put_manifest("m", 2, {"model.onnx": b"V2"})
    store.objects.update(version_files("m", 3, **{"model.onnx": b"v3"}))
    store.put_manifest("m", 3, {"model.onnx": b"v3"})
    for key in [k for k in store.objects if k.startswith("gone/")]:
        del store.objects[key]
    changes = diff(before, store.listing())
    assert changes.appeared == (("m", 3),)
    assert changes.changed == (("m", 2),)
    assert changes.disappeared == (("gone", 1),)
    assert diff(store.listing(), before).appeared == (("gone", 1),)


def test_a_changed_config_changes_every_version_of_its_model() -> None:
    store = _complete_store()
    before = store.listing()
    store.put("m/config.pbtxt", b"config 2")
    assert diff(before, store.listing()).changed == (("m", 1), ("m", 2))


def test_a_version_being_uploaded_again_stays_as_served_until_complete() -> None:
    store = _complete_store()
    served = store.listing()
    store.put("m/1/model.onnx", b"new upload in progress")  # the manifest still the old one
    listed = carry_over(served, store.listing())
    assert listed.models["m"].versions[1] == served.models["m"].versions[1]
    assert not diff(served, listed)
    store.put_manifest("m", 1, {"model.onnx": b"new upload in progress"})
    assert diff(served, carry_over(served, store.listing())).changed == (("m", 1),)


def test_a_refused_model_keeps_what_is_served() -> None:
    store = _complete_store()
    served = store.listing()
    store.put("m/1/../../x", b"hostile")
    listed = carry_over(served, store.listing())
    assert "m" in listed.refused and listed.models["m"] == served.models["m"]
    assert not diff(served, listed)


class ListedSource(LocalSource):
    """A source whose listings the test sets."""

    def __init__(self, listings: list[Listing]) -> None:
        super().__init__(Path("."))
        self.listings = listings

    def list(self) -> Listing:
        return self.listings.pop(0)


def test_poll_lists_again_and_says_what_changed() -> None:
    store = _complete_store()
    first = store.listing()
    store.put("m/config.pbtxt", b"config 2")
    listed, changes = poll(ListedSource([store.listing()]), first)
    assert changes.changed == (("m", 1), ("m", 2)) and listed.models["m"].versions


# --- the cache ----------------------------------------------------------------------------


def _synced(tmp_path: Path) -> tuple[FakeStore, SnapshotCache]:
    store = FakeStore()
    store.put_model(write_identity(tmp_path / "local", "ident", ["FP32"]), "ident")
    cache = SnapshotCache(tmp_path / "cache")
    result = cache.sync(store.listing(), store.fetch, store.where)
    assert not result.problems
    return store, cache


def test_the_cache_is_a_repository_scan_repository_reads(tmp_path: Path) -> None:
    store, cache = _synced(tmp_path)
    (model,) = scan_repository(cache.root)
    assert model.name == "ident" and model.usable and model.versions == (1,)
    local = tmp_path / "local" / "ident"
    assert (cache.root / "ident" / "1" / "model.onnx").read_bytes() == (
        local / "1" / "model.onnx"
    ).read_bytes()
    assert (cache.root / "ident").is_symlink()
    assert not os.listdir(cache.root / ".tmp")
    assert not diff(cache.served(), store.listing())  # what it serves is what was listed


def test_a_switch_shows_readers_the_old_model_until_the_new_one_is_complete(
    tmp_path: Path,
) -> None:
    store, cache = _synced(tmp_path)
    old_config = (cache.root / "ident" / "config.pbtxt").read_text()
    store.put("ident/config.pbtxt", old_config.encode() + b"\n# changed\n")
    seen: list[str] = []
    store.fetched.clear()

    def fetch_and_look(model: str, entry: Entry, sink: Sink) -> None:
        seen.append((cache.root / "ident" / "config.pbtxt").read_text())  # a reader meanwhile
        store.fetch(model, entry, sink)

    cache.sync(store.listing(), fetch_and_look, store.where)
    assert seen == [old_config]
    assert (cache.root / "ident" / "config.pbtxt").read_text().endswith("# changed\n")
    assert store.fetched == ["ident/config.pbtxt"]  # the model file is linked, not fetched
    assert len(os.listdir(cache.root / ".snapshots")) == 1  # the old one is collected


def test_a_failed_download_leaves_the_old_model_whole(tmp_path: Path) -> None:
    store, cache = _synced(tmp_path)
    before = (cache.root / "ident" / "1" / "model.onnx").read_bytes()
    store.put("ident/1/model.onnx", b"new model")
    store.put_manifest("ident", 1, {"model.onnx": b"new model"})

    def half(model: str, entry: Entry, sink: Sink) -> None:
        sink.write(b"new")
        raise SourceError("the connection broke")

    result = cache.sync(store.listing(), half, store.where)
    assert result.problems == {"ident": "the connection broke"}
    assert (cache.root / "ident" / "1" / "model.onnx").read_bytes() == before
    assert not os.listdir(cache.root / ".tmp")


@pytest.mark.parametrize(
    ("sent", "reason"),
    [
        (b"new model and then some more bytes", "sends more than the 9 bytes it listed"),
        (b"new", "received 3 bytes, the listing said 9"),
        (b"NEW MODEL", "does not match the manifest's sha256"),
    ],
)
def test_bytes_that_do_not_match_the_listing_are_refused(
    tmp_path: Path, sent: bytes, reason: str
) -> None:
    store, cache = _synced(tmp_path)
    store.put("ident/1/model.onnx", b"new model")
    store.put_manifest("ident", 1, {"model.onnx": b"new model"})

    def lying(model: str, entry: Entry, sink: Sink) -> None:
        sink.write(sent if entry.path == "1/model.onnx" else store.objects[f"{model}/{entry.path}"])

    result = cache.sync(store.listing(), lying, store.where)
    assert reason in result.problems["ident"]
    assert "'s3://bucket/repo/ident/1/model.onnx'" in result.problems["ident"]
    assert (cache.root / "ident" / "1" / "model.onnx").read_bytes() != b"new model"


def test_unchanged_files_are_linked_not_downloaded_again(tmp_path: Path) -> None:
    store, cache = _synced(tmp_path)
    store.fetched.clear()
    store.put("ident/labels.txt", b"a\nb\n")
    cache.sync(store.listing(), store.fetch, store.where)
    assert store.fetched == ["ident/labels.txt"]
    assert (cache.root / "ident" / "1" / "model.onnx").stat().st_nlink == 1  # old one gone


def test_a_planted_link_in_an_old_snapshot_is_not_followed(tmp_path: Path) -> None:
    store, cache = _synced(tmp_path)
    secret = tmp_path / "secret"
    secret.write_bytes(b"x" * (cache.root / "ident" / "1" / "model.onnx").stat().st_size)
    planted = cache.root / "ident" / "1" / "model.onnx"
    planted.unlink()
    planted.symlink_to(secret)
    store.fetched.clear()
    store.put("ident/labels.txt", b"a\n")
    cache.sync(store.listing(), store.fetch, store.where)
    assert "ident/1/model.onnx" in store.fetched  # downloaded again, not linked from the secret
    assert not (cache.root / "ident" / "1" / "model.onnx").is_symlink()
    assert secret.read_bytes().startswith(b"x")


def test_anything_in_the_cache_sluice_did_not_put_there_is_refused_by_name(
    tmp_path: Path,
) -> None:
    store, cache = _synced(tmp_path)
    (cache.root / "intruder").symlink_to(tmp_path)
    with pytest.raises(SourceError, match="holds 'intruder', which Sluice did not put there"):
        cache.sync(store.listing(), store.fetch, store.where)
    (cache.root / "intruder").unlink()
    os.rename(cache.root / ".tmp", tmp_path / "moved")
    (cache.root / ".tmp").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    with pytest.raises(SourceError, match="is not a folder"):
        cache.sync(store.listing(), store.fetch, store.where)
    assert not (tmp_path / "elsewhere").exists()


def test_models_no_longer_listed_are_removed_and_refused_ones_kept(tmp_path: Path) -> None:
    store, cache = _synced(tmp_path)
    store.put_model(write_identity(tmp_path / "local", "other", ["INT32"]), "other")
    cache.sync(store.listing(), store.fetch, store.where)
    store.put("ident/1/../../../x", b"hostile")
    for key in [k for k in store.objects if k.startswith("other/")]:
        del store.objects[key]
    listing = carry_over(cache.served(), store.listing())
    cache.sync(listing, store.fetch, store.where)
    assert sorted(p.name for p in cache.root.iterdir()) == [".lock", ".snapshots", ".tmp", "ident"]
    assert len(os.listdir(cache.root / ".snapshots")) == 1
    assert [m.name for m in scan_repository(cache.root)] == ["ident"]


def test_a_cached_state_that_does_not_parse_is_downloaded_again(tmp_path: Path) -> None:
    store, cache = _synced(tmp_path)
    state = cache.root / "ident" / ".sluice-snapshot.json"
    state.chmod(0o644)
    state.write_text('{"model": "ident", "shared": [["../../x", 1, "t", ""]], "versions": {}}')
    assert cache.served() == Listing()
    store.fetched.clear()
    cache.sync(store.listing(), store.fetch, store.where)
    assert sorted(store.fetched) == ["ident/1/model.onnx", "ident/config.pbtxt"]


# --- the local source ---------------------------------------------------------------------


def test_a_local_repository_is_served_in_place_and_its_changes_are_seen(tmp_path: Path) -> None:
    model = write_identity(tmp_path, "ident", ["FP32"])
    source = LocalSource(tmp_path)
    first = source.list()
    assert list(first.models["ident"].versions) == [1]
    assert [e.path for e in first.models["ident"].shared] == ["config.pbtxt"]
    assert source.materialise(first).root == tmp_path
    (model / "2").mkdir()
    (model / "2" / "model.onnx").write_bytes((model / "1" / "model.onnx").read_bytes())
    config = model / "config.pbtxt"
    config.write_text(config.read_text() + "\n")
    os.utime(config, ns=(1, 1))
    changes = diff(first, source.list())
    assert changes.appeared == (("ident", 2),) and changes.changed == (("ident", 1),)
    snapshot = snapshot_repository(str(tmp_path), RepositorySourceSettings())
    assert snapshot == tmp_path.resolve()


def test_a_missing_local_repository_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(SourceError, match="cannot list the model repository"):
        LocalSource(tmp_path / "nothing").list()


def test_unknown_schemes_and_missing_boto3_are_clear_errors(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    settings = RepositorySourceSettings()
    with pytest.raises(SourceError, match="unsupported scheme 'gs://'"):
        open_source("gs://bucket/models", settings)
    monkeypatch.delitem(sys.modules, "sluice.scheduler.repository.s3")
    monkeypatch.setitem(sys.modules, "boto3", None)
    with pytest.raises(SourceError, match=r"pip install 'sluice\[s3\]'"):
        open_source("s3://bucket/models", settings)


# --- S3 against a stub client ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("s3://bucket", ("bucket", "")),
        ("s3://bucket/", ("bucket", "")),
        ("s3://bucket/models", ("bucket", "models/")),
        ("s3://bucket/a/b/", ("bucket", "a/b/")),
    ],
)
def test_s3_urls(url: str, expected: tuple[str, str]) -> None:
    assert parse_s3_url(url) == expected


@pytest.mark.parametrize(
    "url", ["s3://", "s3://../x", "s3://bucket/a/../b", "s3://b/cket", "s3://b\\x/m"]
)
def test_bad_s3_urls(url: str) -> None:
    with pytest.raises(SourceError, match="model repository"):
        parse_s3_url(url)


class StubBody:
    def __init__(self, chunks: list[bytes | Exception]) -> None:
        self.chunks = chunks

    def read(self, size: int) -> bytes:
        if not self.chunks:
            return b""
        chunk = self.chunks.pop(0)
        if isinstance(chunk, Exception):
            raise chunk
        return chunk

    def close(self) -> None:
        pass


class StubClient:
    """Lists ``objects`` ({key: bytes}) under any prefix and answers get_object with
    ``bodies[key]`` (a list of responses, each a list of chunks or errors) when set."""

    def __init__(self, objects: dict[str, bytes], extra_keys: tuple[str, ...] = ()) -> None:
        self.objects = objects
        self.extra_keys = extra_keys
        self.bodies: dict[str, list[list[bytes | Exception]]] = {}
        self.requests: list[dict[str, Any]] = []

    def get_paginator(self, name: str) -> StubClient:
        assert name == "list_objects_v2"
        return self

    def paginate(self, Bucket: str, Prefix: str) -> list[dict[str, Any]]:
        contents = [
            {"Key": key, "Size": len(data), "ETag": f'"{hashlib.md5(data).hexdigest()}"'}
            for key, data in sorted(self.objects.items())
        ]
        contents += [{"Key": key, "Size": 1, "ETag": '"x"'} for key in self.extra_keys]
        return [{"Contents": contents[:2]}, {"Contents": contents[2:]}]

    def get_object(self, **request: Any) -> dict[str, Any]:
        self.requests.append(request)
        data = self.objects[request["Key"]]
        queued = self.bodies.get(request["Key"])
        chunks = queued.pop(0) if queued else [data]
        etag = f'"{hashlib.md5(data).hexdigest()}"'
        return {"ETag": etag, "ContentLength": len(data), "Body": StubBody(list(chunks))}


def _stub_repository(tmp_path: Path) -> dict[str, bytes]:
    store = FakeStore()
    store.put_model(write_identity(tmp_path / "local", "ident", ["FP32"]), "ident")
    return {f"repo/{key}": data for key, data in store.objects.items()}


def _source(tmp_path: Path, client: StubClient, **settings: Any) -> S3Source:
    config = RepositorySourceSettings(
        repository_cache_dir=str(tmp_path / "cache"), s3_attempts=3, **settings
    )
    return S3Source("s3://bucket/repo", config, client=client)


def test_a_download_that_breaks_off_is_started_again(tmp_path: Path) -> None:
    objects = _stub_repository(tmp_path)
    client = StubClient(objects)
    data = objects["repo/ident/1/model.onnx"]
    timeout = ReadTimeoutError(endpoint_url="http://store")
    client.bodies["repo/ident/1/model.onnx"] = [[data[:10], timeout], [data[:5], OSError("reset")]]
    source = _source(tmp_path, client)
    result = source.materialise(source.list())
    assert not result.problems
    assert (result.root / "ident" / "1" / "model.onnx").read_bytes() == data
    gets = [r for r in client.requests if r["Key"] == "repo/ident/1/model.onnx"]
    assert len(gets) == 3 and all(r["IfMatch"].startswith('"') for r in gets)


def test_a_download_that_keeps_failing_is_reported_with_the_key(tmp_path: Path) -> None:
    objects = _stub_repository(tmp_path)
    client = StubClient(objects)
    broken: list[bytes | Exception] = [ReadTimeoutError(endpoint_url="http://store")]
    client.bodies["repo/ident/1/model.onnx"] = [list(broken) for _ in range(3)]
    source = _source(tmp_path, client)
    result = source.materialise(source.list())
    problem = result.problems["ident"]
    assert "'s3://bucket/repo/ident/1/model.onnx': the download broke off 3 time(s)" in problem
    assert "Read timeout" in problem
    assert not (result.root / "ident").exists()


def test_a_store_sending_more_than_it_listed_is_cut_off(tmp_path: Path) -> None:
    objects = _stub_repository(tmp_path)
    client = StubClient(objects)
    data = objects["repo/ident/1/model.onnx"]
    client.bodies["repo/ident/1/model.onnx"] = [[data, b"and an endless stream" * 100]]
    source = _source(tmp_path, client)
    result = source.materialise(source.list())
    assert "sends more than the" in result.problems["ident"]


def test_keys_outside_the_prefix_and_too_many_objects_are_refused(tmp_path: Path) -> None:
    client = StubClient(_stub_repository(tmp_path), extra_keys=("elsewhere/1/model.onnx",))
    listing = _source(tmp_path, client).list()
    assert list(listing.models) == ["ident"]
    assert any("'elsewhere/1/model.onnx': it is outside the prefix" in m for m in listing.ignored)
    with pytest.raises(SourceError, match="more than 2 objects under the prefix"):
        _source(tmp_path, client, s3_max_objects=2).list()


def test_manifests_are_read_once_per_etag(tmp_path: Path) -> None:
    client = StubClient(_stub_repository(tmp_path))
    source = _source(tmp_path, client)
    source.list()
    source.list()
    assert [r["Key"] for r in client.requests] == [f"repo/ident/1/{MANIFEST_NAME}"]


def test_sink_reset_starts_over(tmp_path: Path) -> None:
    entry = Entry("1/x", 3, "t", hashlib.sha256(b"abc").hexdigest())
    stream = io.BytesIO()
    sink = Sink(stream, entry, "'x'")
    sink.write(b"zz")
    sink.reset()
    sink.write(b"abc")
    sink.finish()
    assert stream.getvalue() == b"abc"
