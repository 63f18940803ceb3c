"""A load that fails (explicit model control, poll mode's loads) leaves the model as Triton's
repository manager leaves it: listed ``UNAVAILABLE``, each version it tried with why (a
version that loaded while another failed: ``unloaded``), answered with Triton's texts for a
model whose load failed, until a load succeeds or an unload clears it; a failed reload
keeps what serves. Against a real Redis, with workers that are not processes: each is
failed, or announced, by hand."""

from __future__ import annotations

import json
import socket
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import cast

import pytest
from redis import Redis
from redis.asyncio import Redis as AsyncRedis

from sluice.core.catalog import UNLOADED, CatalogEntry, decode_entry
from sluice.core.clock import CLOCK
from sluice.core.control import ControlCommand, encode_command
from sluice.core.keys import Keys, load_error_field
from sluice.core.repository import RepositoryModel, read_model
from sluice.gateway.control.catalog_view import CatalogView, NoReadyVersion
from sluice.scheduler.executor.catalog_publisher import publish_catalog
from sluice.scheduler.executor.model_control import ModelControl
from sluice.scheduler.executor.redis_server import RedisServer
from sluice.scheduler.executor.supervisor import Child, ChildSpec, Process, Supervisor
from tests.support.model_files import python_config, tensor, write_model

CONFIG = python_config(
    [tensor("x", "TYPE_FP32", "2")],
    [tensor("y", "TYPE_FP32", "2")],
    extra="version_policy: { all { } }",
)
MODEL = "class Model:\n    def execute(self, inputs):\n        return {'y': inputs['x']}\n"


class Workers(Supervisor):
    """Starts no process: the children of each load are kept to be failed or announced."""

    def __init__(self) -> None:
        super().__init__([])
        self.started: list[list[Child]] = []

    def add(self, specs: Sequence[ChildSpec]) -> list[Child]:
        children = [Child(spec) for spec in specs]
        self.started.append(children)
        return children

    def retire(self, children: Sequence[Child], grace_s: float | None = None) -> None:
        for child in children:
            child.retiring = True


@dataclass
class Setup:
    client: Redis
    keys: Keys
    repository: Path
    control: ModelControl
    workers: Workers
    errors_keys: list[str] = field(default_factory=list)

    def send(self, op: str, model: str = "m", **fields: object) -> ControlCommand:
        command = ControlCommand(op, model, **fields)  # type: ignore[arg-type]
        self.client.xadd(self.keys.control_requests, encode_command(command))  # type: ignore[arg-type]
        self.control.tick()
        return command

    def answer(self, command: ControlCommand) -> object:
        """The command's answer (its error; None for success), or ``"none"`` if not sent."""
        raw = self.client.lpop(self.keys.control_reply(command.command_id))
        return "none" if raw is None else json.loads(cast(bytes, raw))["error"]

    def fail(self, version: int, reason: str | None) -> None:
        """The last load's worker of ``version`` could not load it (saying ``reason``)."""
        for child in self.workers.started[-1]:
            if child.spec.version == version:
                child.failed = True
        if reason is not None:
            field_name = load_error_field("m", version)
            self.client.hset(self.errors_keys[-1], field_name, reason)
        self.control.tick()

    def announce(self) -> None:
        """Every worker of the last load sends its first heartbeat."""
        CLOCK.sync_blocking(self.client)
        for pid, child in enumerate(self.workers.started[-1], start=40_000):
            child.process = cast(Process, SimpleNamespace(pid=pid, poll=lambda: None))
            member = f"{socket.gethostname()}-{pid}-w"
            assert child.spec.version is not None
            live = self.keys.live_workers("m", child.spec.version)
            self.client.zadd(live, {member: CLOCK.now() + 600})
        self.control.tick()

    def catalog(self) -> dict[str, CatalogEntry]:
        raw = cast(dict[bytes, bytes], self.client.hgetall(self.keys.catalog))
        return {k.decode(): decode_entry(v) for k, v in raw.items()}

    def load_errors(self) -> dict[str, str]:
        raw = cast(dict[bytes, bytes], self.client.hgetall(self.keys.load_errors))
        return {k.decode(): v.decode() for k, v in raw.items()}

    async def view(self, url: str) -> CatalogView:
        """What a gateway reads of it."""
        view = CatalogView(self.keys)
        async with AsyncRedis.from_url(url) as redis:
            await view.refresh(redis)
        return view


@pytest.fixture
def setup(redis_server: RedisServer, tmp_path: Path) -> Iterator[Setup]:
    """An executor (explicit model control) over a repository holding ``m`` (versions 1
    and 2), which it has not loaded."""
    keys = Keys(f"failures-{uuid.uuid4().hex[:8]}")
    client = Redis.from_url(redis_server.url)
    repository = tmp_path / "repository"
    write_model(repository, "m", CONFIG, {"1/model.py": MODEL, "2/model.py": MODEL})
    workers = Workers()
    errors_keys: list[str] = []
    control: ModelControl

    def specs(model: RepositoryModel, root: Path, env: dict[str, str]) -> list[ChildSpec]:
        errors_keys.append(env["SLUICE_LOAD_ERRORS_KEY"])
        return [ChildSpec(f"m-{v}", ["true"], env, version=v) for v in model.versions]

    def publish() -> None:
        publish_catalog(client, keys, control.catalog())

    control = ModelControl(
        client,
        keys,
        repository,
        tmp_path / "staging",
        workers,
        specs,
        {},
        600.0,
        {},
        publish,
    )
    try:
        publish()
        control.start()
        yield Setup(client, keys, repository, control, workers, errors_keys)
    finally:
        client.close()


async def test_a_failed_load_is_listed_unavailable_with_why_until_a_load_succeeds(
    setup: Setup, redis_server: RedisServer
) -> None:
    load = setup.send("load")
    setup.fail(2, "SyntaxError: invalid syntax (model.py, line 1)")
    assert setup.answer(load) == (
        "failed to load 'm', SyntaxError: invalid syntax (model.py, line 1)"
    )
    entry = setup.catalog()["m"]
    assert (entry.versions, entry.error, entry.config is not None) == ((1, 2), None, True)
    assert setup.load_errors() == {
        "m:1": UNLOADED,  # (its worker had not failed: let go with the others, as Triton)
        "m:2": "SyntaxError: invalid syntax (model.py, line 1)",
    }
    view = await setup.view(redis_server.url)
    with pytest.raises(NoReadyVersion, match="'m' has no available versions"):
        view.resolve("m", None)
    assert view.not_ready() == ["'m' version 2 (unavailable)"]

    again = setup.send("load")
    setup.announce()
    assert setup.answer(again) is None
    entry = setup.catalog()["m"]
    assert (entry.versions, entry.error) == ((1, 2), None)
    assert setup.load_errors() == {}
    assert "m" in setup.control.loaded


async def test_an_unload_clears_a_failed_load(setup: Setup, redis_server: RedisServer) -> None:
    load = setup.send("load")
    setup.fail(1, None)  # (exited while loading, saying nothing)
    assert setup.answer(load) == "failed to load 'm', its worker exited while loading"
    assert setup.load_errors() == {"m:1": "its worker exited while loading", "m:2": UNLOADED}

    unload = setup.send("unload")
    assert setup.answer(unload) is None
    entry = setup.catalog()["m"]
    assert (entry.error, entry.once_loaded) == (UNLOADED, True)
    assert setup.load_errors() == {}
    assert (await setup.view(redis_server.url)).not_ready() == []


def test_a_load_refused_before_its_workers_start_is_listed_with_the_reason(
    setup: Setup,
) -> None:
    (setup.repository / "m" / "config.pbtxt").write_text('name: "m"\nmax_batch_size: eight\n')
    load = setup.send("load")
    reason = cast(str, setup.answer(load))
    assert reason.startswith("failed to load 'm', ")
    entry = setup.catalog()["m"]
    assert (entry.versions, entry.config) == ((), None)
    assert entry.error == reason.removeprefix("failed to load 'm', ")
    assert setup.workers.started == []


def test_a_refused_request_leaves_the_model_as_it_was(setup: Setup) -> None:
    """A request the executor cannot carry out as asked (here, files one of which is also a
    folder) loads nothing: the model is still one never loaded."""
    config = json.dumps({"backend": "python", "max_batch_size": 2})
    load = setup.send("load", config=config, files={"1": b"x", "1/model.py": b"y"})
    assert "is both a file and a folder" in str(setup.answer(load))
    entry = setup.catalog()["m"]
    assert (entry.error, entry.once_loaded) == (UNLOADED, False)


def test_a_failed_reload_keeps_serving_what_served(setup: Setup) -> None:
    model = read_model(setup.repository / "m")
    setup.control.loaded["m"] = (model, [])
    setup.control.on_change()
    load = setup.send("load")
    setup.fail(1, "out of memory")
    assert setup.answer(load) == "failed to load 'm', out of memory"
    entry = setup.catalog()["m"]
    assert (entry.versions, entry.error, entry.config) == ((1, 2), None, model.config)
    assert setup.load_errors() == {}
    assert setup.control.loaded["m"][0] is model


def test_the_reasons_are_written_again_when_redis_lost_them(setup: Setup) -> None:
    """An executor that starts clears every load error (so does a Redis restart without
    persistence): the failed versions would then look as if still loading."""
    load = setup.send("load")
    setup.fail(2, "bad file")
    assert setup.answer(load) == "failed to load 'm', bad file"
    setup.client.delete(setup.keys.load_errors)
    setup.control._present_due = 0.0
    setup.control.tick()
    assert setup.load_errors() == {"m:1": UNLOADED, "m:2": "bad file"}
