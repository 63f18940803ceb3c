"""Model control pieces without a server: hostile names and override paths, the command
wire format, and the supervisor's added and retired children."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import msgpack
import pytest
from redis import Redis

from sluice.core.control import ControlCommand, decode_command, encode_command
from sluice.core.errors import InvalidInput
from sluice.core.keys import Keys
from sluice.scheduler.executor.model_control import ModelControl
from sluice.scheduler.executor.redis_server import RedisServer
from sluice.scheduler.executor.supervisor import ChildSpec, Supervisor
from sluice.scheduler.repository.staging import check_model_name, stage

CONFIG = json.dumps({"backend": "onnxruntime", "max_batch_size": 2})


@pytest.mark.parametrize(
    "name",
    [
        *("", ".", "..", ".hidden", "a/b", "a\\b", "a\0b", "x" * 256, "\u00e9" * 128, "a\udc80"),
        *("a\nb", "a\rb", "a\x1b[2Jb", "a\x7fb"),
    ],
)
def test_model_names_that_are_not_one_directory_are_refused(name: str) -> None:
    """A name is one folder: at most 255 bytes as the filesystem counts them (``é`` is two),
    so that no name reaches the filesystem to fail there."""
    with pytest.raises(InvalidInput, match="invalid model name"):
        check_model_name(name)
    check_model_name("\u00e9" * 127)


@pytest.mark.parametrize(
    "path",
    [
        "../escape",
        "/etc/passwd",
        "1/../../x",
        "a\\b",
        "",
        "config.pbtxt",
        "1//model.onnx",  # two overrides of one file, with 1/./model.onnx or 1/model.onnx
        "1/./model.onnx",
        "1/",
        "1/model\x00.onnx",
        "1/model\n.onnx",
        "1/" + "x" * 256,  # longer than a file name may be
        "/".join(["d"] * 40) + "/f",  # deeper than a model's files may be
    ],
)
def test_file_overrides_stay_inside_the_staged_model(tmp_path: Path, path: str) -> None:
    with pytest.raises(InvalidInput, match="invalid file override path"):
        stage(tmp_path / "repo" / "m", tmp_path / "staged", CONFIG, {path: b"x"})
    assert not (tmp_path / "escape").exists()
    assert not (tmp_path / "staged").exists()  # refused before anything is written


@pytest.mark.parametrize(
    "files",
    [{"1": b"x", "1/model.onnx": b"y"}, {"1/model.onnx": b"y", "1": b"x"}],
)
def test_a_path_that_is_both_a_file_and_a_folder_is_refused(
    tmp_path: Path, files: dict[str, bytes]
) -> None:
    with pytest.raises(InvalidInput, match="file override path '1' is both a file and a folder"):
        stage(tmp_path / "repo" / "m", tmp_path / "staged", CONFIG, files)
    assert not (tmp_path / "staged").exists()


def test_a_config_override_keeps_the_model_files(tmp_path: Path) -> None:
    model = tmp_path / "repo" / "m"
    (model / "1").mkdir(parents=True)
    (model / "1" / "model.onnx").write_bytes(b"onnx")
    (model / "config.pbtxt").write_text('backend: "onnxruntime"')
    staged = stage(model, tmp_path / "staged", CONFIG, {})
    assert (staged / "1" / "model.onnx").read_bytes() == b"onnx"
    assert "max_batch_size: 2" in (staged / "config.pbtxt").read_text()
    assert (model / "config.pbtxt").read_text() == 'backend: "onnxruntime"'  # untouched
    assert stage(model, tmp_path / "staged2", None, {}) == model  # nothing to override


def test_files_need_a_config_and_a_config_must_parse(tmp_path: Path) -> None:
    with pytest.raises(InvalidInput, match="configuration must be provided"):
        stage(tmp_path / "m", tmp_path / "s", None, {"1/model.onnx": b"x"})
    with pytest.raises(InvalidInput, match="failed to parse the model configuration"):
        stage(tmp_path / "m", tmp_path / "s", '{"max_batch_size": "many"}', {"1/a": b"x"})


def test_commands_round_trip_and_malformed_ones_are_dropped() -> None:
    command = ControlCommand("load", "m", CONFIG, {"1/model.onnx": b"\x00\x01"})
    decoded = decode_command(encode_command(command))
    assert decoded == command
    for fields in (
        {},
        {b"c": b"\xc1"},
        {b"c": msgpack.packb({"id": "1", "op": "format", "model": "m"})},
        {b"c": msgpack.packb({"id": "1", "op": "load", "model": "m", "files": [1]})},
        {b"c": msgpack.packb([1, 2])},
        {b"c": msgpack.packb({"id": "1", "op": "load", "model": "m", "token": -1})},
        {b"c": msgpack.packb({"id": "1", "op": "load", "model": "m", "token": "7"})},
    ):
        assert decode_command(fields) is None


def test_the_executor_refuses_a_command_of_a_replaced_controller(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    """A command carrying a fencing token older than one already seen was sent by a
    controller that has been replaced since: refused, with the reason."""
    keys = Keys("fencing-unit")
    client = Redis.from_url(redis_server.url)
    control = ModelControl(
        client, keys, tmp_path, tmp_path, Supervisor([]), lambda *_: [], {}, 5.0, {}, lambda: None
    )
    try:
        control.start()
        newer, older, gateways = (
            ControlCommand("unload", "m", token=7),
            ControlCommand("unload", "m", token=6),
            ControlCommand("unload", "m"),  # from a gateway: no token
        )
        for command in (newer, older, gateways):
            client.xadd(keys.control_requests, encode_command(command))  # type: ignore[arg-type]
        for _ in range(3):
            control.tick()

        def answer(command: ControlCommand) -> object:
            raw = client.lpop(keys.control_reply(command.command_id))
            assert isinstance(raw, bytes), command
            return json.loads(raw)["error"]

        assert answer(newer) is None  # unloading what is not loaded succeeds, as in Triton
        assert "no longer leads (token 6, newest 7)" in str(answer(older))
        assert answer(gateways) is None
    finally:
        client.close()


def test_every_load_is_answered_and_a_failed_one_leaves_nothing_staged(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    """Overrides the filesystem would refuse are refused with the reason (the executor
    used to fail its tick on them and never answer: the client waited for the timeout),
    and what a failed load staged is removed (each used to stay until ``sluice up`` ended)."""
    keys = Keys("staging-unit")
    client = Redis.from_url(redis_server.url)
    repository, staging = tmp_path / "repo", tmp_path / "staging"
    repository.mkdir()
    staging.mkdir()
    control = ModelControl(
        client, keys, repository, staging, Supervisor([]), lambda *_: [], {}, 5.0, {}, lambda: None
    )
    commands = [
        (
            ControlCommand("load", "m", CONFIG, {"1": b"x", "1/model.onnx": b"y"}),
            "failed to load 'm', file override path '1' is both a file and a folder",
        ),
        (
            ControlCommand("load", "\u00e9" * 200, CONFIG, {"1/model.onnx": b"y"}),
            "invalid model name",
        ),
        (ControlCommand("load", "m", CONFIG, {"0/model.onnx": b"y"}), "failed to load 'm', "),
    ]
    try:
        control.start()
        for command, _ in commands:
            client.xadd(keys.control_requests, encode_command(command))  # type: ignore[arg-type]
        for _ in range(len(commands) + 1):
            control.tick()
        for command, reason in commands:
            raw = client.lpop(keys.control_reply(command.command_id))
            assert isinstance(raw, bytes), command.files
            assert reason in str(json.loads(raw)["error"])
        assert list(staging.iterdir()) == []
    finally:
        client.close()


def test_added_children_run_and_retired_ones_are_not_restarted() -> None:
    supervisor = Supervisor([])
    sleeper = ChildSpec("sleeper", [sys.executable, "-c", "import time; time.sleep(60)"], {})
    (child,) = supervisor.add([sleeper])
    try:
        assert child.running
        supervisor.retire([child])
        deadline = time.monotonic() + 10
        while child.running and time.monotonic() < deadline:
            time.sleep(0.05)
        supervisor.tick()
        assert supervisor.children == []
    finally:
        supervisor.stop()
