"""How each model was loaded, recorded in a real Redis and staged again for an executor
that joins: a configuration of its own, files alone, versions; cleared by a plain load and
an unload; a record that cannot be used leaves the model to the repository."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import msgpack
import pytest
from redis import Redis

from sluice.core.control import ControlCommand, decode_command
from sluice.core.keys import Keys
from sluice.core.repository import RepositoryModel, read_model
from sluice.scheduler.executor import loaded_as
from sluice.scheduler.executor.loaded_as import (
    forget_load,
    recorded_loads,
    remember_load,
    staged_loads,
)
from sluice.scheduler.executor.redis_server import RedisServer
from tests.support.onnx_models import write_identity


@pytest.fixture
def client(redis_server: RedisServer) -> Iterator[Redis]:
    with Redis.from_url(redis_server.url) as redis:
        yield redis


@pytest.fixture
def keys() -> Keys:
    return Keys(f"t{uuid.uuid4().hex[:8]}")


def config_of(model_dir: Path, **changes: object) -> str:
    config = read_model(model_dir).config
    assert config is not None
    return json.dumps({**dict(config.raw), **changes})


def loads_of_others(
    client: Redis, keys: Keys, names: set[str], repository: Path, staging: Path
) -> dict[str, RepositoryModel]:
    """What a joining executor loads as the others did: their records, staged."""
    return staged_loads(recorded_loads(client, keys, names), repository, staging)


def test_a_joining_executor_stages_each_load_as_it_was_carried_out(
    tmp_path: Path, client: Redis, keys: Keys
) -> None:
    repository = tmp_path / "repository"
    source = write_identity(repository, "tuned", ["FP32"])
    (source / "2").mkdir()
    (source / "2" / "model.onnx").write_bytes((source / "1" / "model.onnx").read_bytes())
    tuned = ControlCommand("load", "tuned", config=config_of(source, max_batch_size=2))
    onnx = (source / "1" / "model.onnx").read_bytes()
    files = {"1/model.onnx": onnx}
    uploaded_config = config_of(source, name="uploaded")
    uploaded = ControlCommand("load", "uploaded", config=uploaded_config, files=files)
    remember_load(client, keys, tuned)
    remember_load(client, keys, uploaded)
    remember_load(client, keys, ControlCommand("load", "rolled", versions=(1,)))

    staged = loads_of_others(client, keys, {"tuned", "uploaded"}, repository, tmp_path / "s")
    assert set(staged) == {"tuned", "uploaded"}  # ("rolled" was not asked for)
    assert staged["tuned"].config is not None and staged["tuned"].config.max_batch_size == 2
    assert staged["tuned"].path != source  # (a staged copy: the repository is untouched)
    assert staged["uploaded"].versions == (1,)
    assert (staged["uploaded"].path / "1" / "model.onnx").read_bytes() == onnx

    write_identity(repository, "rolled", ["FP32"])
    (repository / "rolled" / "2").mkdir()
    (repository / "rolled" / "2" / "model.onnx").write_bytes(onnx)
    rolled = loads_of_others(client, keys, {"rolled"}, repository, tmp_path / "s")["rolled"]
    assert rolled.versions == (1,)  # (the versions it was loaded with, not the newest)


def test_a_plain_load_and_an_unload_clear_the_record(client: Redis, keys: Keys) -> None:
    remember_load(client, keys, ControlCommand("load", "m", config="{}"))
    assert client.hget(keys.loaded_as, "m") is not None
    remember_load(client, keys, ControlCommand("load", "m"))
    assert client.hget(keys.loaded_as, "m") is None
    remember_load(client, keys, ControlCommand("load", "m", versions=(3,)))
    forget_load(client, keys, "m")
    assert client.hlen(keys.loaded_as) == 0


def test_a_new_configuration_of_uploaded_files_keeps_the_files(
    tmp_path: Path, client: Redis, keys: Keys
) -> None:
    """A model loaded from files alone, then loaded with a new configuration only (which
    applies to those files): the record keeps the files."""
    source = write_identity(tmp_path / "repository", "m", ["FP32"])
    files = {"1/model.onnx": (source / "1" / "model.onnx").read_bytes()}
    first = ControlCommand("load", "up", config=config_of(source, name="up"), files=files)
    remember_load(client, keys, first)
    again = ControlCommand("load", "up", config=config_of(source, name="up", max_batch_size=2))
    remember_load(client, keys, again, files_of_previous=True)
    [model] = loads_of_others(client, keys, {"up"}, tmp_path / "empty", tmp_path / "s").values()
    assert model.config is not None and model.config.max_batch_size == 2
    assert (model.path / "1" / "model.onnx").read_bytes() == files["1/model.onnx"]


def test_a_record_that_cannot_be_used_leaves_the_model_to_the_repository(
    tmp_path: Path, client: Redis, keys: Keys, caplog: pytest.LogCaptureFixture
) -> None:
    client.hset(keys.loaded_as, "garbled", b"\x00not msgpack")
    missing = ControlCommand("load", "missing", config="{}")  # no folder, no files
    remember_load(client, keys, missing)
    broken = write_identity(tmp_path / "repository", "broken", ["FP32"])
    remember_load(client, keys, ControlCommand("load", "broken", config='{"max_batch_size": -1}'))
    names = {"garbled", "missing", "broken"}
    assert loads_of_others(client, keys, names, broken.parent, tmp_path / "s") == {}
    warned = " ".join(record.getMessage() for record in caplog.records)
    assert "'garbled'" in warned and "'missing'" in warned and "'broken'" in warned


def test_files_added_to_a_model_are_kept_with_the_first_ones(client: Redis, keys: Keys) -> None:
    """A TorchServe version registered beside another (keep_files): the record holds both
    archives, so a joining host serves both versions."""
    first = ControlCommand("load", "ts", config="{}", files={"1/model.mar": b"one"})
    remember_load(client, keys, first)
    added = ControlCommand(
        "load", "ts", config="{}", files={"2/model.mar": b"two"}, keep_files=True
    )
    remember_load(client, keys, added)
    value = client.hget(keys.loaded_as, "ts")
    assert value is not None
    recorded = decode_command({b"c": value})
    assert recorded is not None
    assert recorded.files == {"1/model.mar": b"one", "2/model.mar": b"two"}


def test_a_load_with_too_many_file_bytes_is_not_recorded(
    client: Redis, keys: Keys, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Redis keeps a record as long as its model is loaded: one whose files are larger than
    the bound is left out (a joining host loads that model from its repository)."""
    monkeypatch.setattr(loaded_as, "RECORDED_FILES_MAX_BYTES", 10)
    remember_load(client, keys, ControlCommand("load", "big", config="{}", files={"f": b"x" * 5}))
    assert client.hget(keys.loaded_as, "big") is not None
    remember_load(client, keys, ControlCommand("load", "big", config="{}", files={"f": b"x" * 11}))
    assert client.hget(keys.loaded_as, "big") is None
    assert "'big' was loaded with 0 MiB of files, more than the 0 MiB" in caplog.text


@pytest.mark.parametrize("name", ["../outside", "/outside", "x/..", "a\0b", ".hidden", ""])
def test_a_record_whose_name_leaves_the_repository_is_not_staged(
    tmp_path: Path, name: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A record's name comes from Redis or a snapshot file: one that is not a model name of
    the repository (a path out of it, a NUL byte) is left out with a warning; nothing
    outside the repository is staged and the staging folder stays."""
    repository = tmp_path / "repository"
    write_identity(repository, "m", ["FP32"])
    outside = write_identity(tmp_path, "outside", ["FP32"])
    staging = tmp_path / "staging"
    staging.mkdir()
    (staging / "kept").touch()
    command = ControlCommand("load", name, config=config_of(outside, name=""))
    assert staged_loads({name: command}, repository, staging / "run") == {}
    assert (staging / "kept").exists()
    assert "invalid model name" in caplog.text


@pytest.mark.parametrize("content", [2**64 - 1, 10**12, "text", None])
def test_a_record_whose_files_are_not_bytes_is_left_out(
    client: Redis, keys: Keys, content: object, caplog: pytest.LogCaptureFixture
) -> None:
    """A number where a file's bytes belong made ``bytes(n)``: n zero bytes (memory for a
    large one) or an OverflowError that ended the executor's start."""
    body = {"id": "x", "op": "load", "model": "m", "config": "{}", "files": {"f": content}}
    client.hset(keys.loaded_as, "m", msgpack.packb(body))
    assert recorded_loads(client, keys, {"m"}) == {}
    assert "ignoring the malformed record of how 'm' was loaded" in caplog.text
