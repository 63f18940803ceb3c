"""An unload judges the model's streams empty only once every live gateway has applied the
catalog without it: until then a gateway (an idle one reads the catalog every 2 s) may still
queue a request for it, which no worker would ever answer. On a fake monotonic clock:
nothing here depends on the machine's speed."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
from redis import Redis

from sluice.core.catalog_applied import APPLIED_REVISION, CATCH_UP_S, published_revision
from sluice.core.clock import CLOCK
from sluice.core.control import ControlCommand, encode_command
from sluice.core.keys import Keys
from sluice.core.repository import RepositoryModel
from sluice.scheduler.executor import model_control
from sluice.scheduler.executor.catalog_publisher import publish_catalog
from sluice.scheduler.executor.model_control import ModelControl
from sluice.scheduler.executor.redis_server import RedisServer
from sluice.scheduler.executor.supervisor import Child, ChildSpec, Supervisor

OLD_SETTLE_S = 1.5
"""The fixed wait an unload used to make before judging the streams."""


@dataclass
class Setup:
    client: Redis
    keys: Keys
    control: ModelControl
    clock: list[float]
    worker: Child

    def gateway(self, gateway_id: str, revision: int | None, live: bool = True) -> None:
        """A gateway process's report, as it writes it each refresh (live for a minute on
        the deployment's clock, or expired a second ago)."""
        report = self.keys.gateway_report(gateway_id)
        self.client.delete(report)
        fields: dict[str, int] = {"in_flight": 0}
        if revision is not None:
            fields[APPLIED_REVISION] = revision
        self.client.hset(report, mapping=fields)  # type: ignore[arg-type]
        self.client.expire(report, 60)
        CLOCK.sync_blocking(self.client)
        expiry = CLOCK.now() + (60 if live else -1)
        self.client.zadd(self.keys.gateways, {gateway_id: expiry})

    def revision(self) -> int:
        revision = published_revision(self.client, self.keys)
        assert revision is not None
        return revision

    def unload(self) -> ControlCommand:
        command = ControlCommand("unload", "m")
        self.client.xadd(self.keys.control_requests, encode_command(command))  # type: ignore[arg-type]
        return command

    def answer(self, command: ControlCommand) -> object:
        """The unload's answer (its error; None for success), or ``"none"`` if not sent."""
        raw = self.client.lpop(self.keys.control_reply(command.command_id))
        return "none" if raw is None else json.loads(raw)["error"]  # type: ignore[arg-type]

    def ticks(self, count: int = 3) -> None:
        for _ in range(count):
            self.control.tick()

    def settle(self) -> None:
        """Ticks past the grace for appends already on their way once the gateways caught
        up."""
        self.ticks()
        self.clock[0] += model_control._APPEND_GRACE_S
        self.ticks()


@pytest.fixture
def setup(
    redis_server: RedisServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Setup]:
    """An executor serving model ``m`` (one worker, not a real process; no config, so its
    streams count as empty), whose catalog is published."""
    keys = Keys(f"drain-unit-{tmp_path.name}")
    client = Redis.from_url(redis_server.url)
    clock = [1000.0]
    monkeypatch.setattr(model_control, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    worker = Child(ChildSpec("m-1", ["true"], {}))
    model = RepositoryModel("m", tmp_path / "m", None, (1,))
    control: ModelControl

    def publish() -> None:
        publish_catalog(client, keys, control.catalog())

    control = ModelControl(
        client,
        keys,
        tmp_path / "repository",
        tmp_path / "staging",
        Supervisor([]),
        lambda *_: [],
        {},
        5.0,
        {"m": (model, [worker])},
        publish,
    )
    try:
        publish()
        control.start()
        yield Setup(client, keys, control, clock, worker)
    finally:
        client.close()


def test_an_unload_waits_until_every_live_gateway_applied_the_catalog_without_the_model(
    setup: Setup,
) -> None:
    before = setup.revision()
    setup.gateway("idle", before)  # has not read the catalog since the unload
    setup.gateway("gone-report", before)
    setup.client.delete(setup.keys.gateway_report("gone-report"))  # its report expired
    setup.gateway("dead", before, live=False)  # stopped refreshing a while ago
    command = setup.unload()
    setup.ticks()
    after = setup.revision()
    assert after > before
    assert setup.answer(command) == "none"

    setup.clock[0] += CATCH_UP_S / 2  # long after the old fixed wait, within the bound
    assert CATCH_UP_S / 2 > 3 * OLD_SETTLE_S
    setup.ticks()
    assert setup.answer(command) == "none"  # the idle gateway may still queue a request
    assert not setup.worker.retiring
    assert setup.control.busy

    setup.gateway("idle", after)  # its next refresh
    setup.ticks()
    assert not setup.worker.retiring  # a request it matched before may be on its way in
    setup.settle()
    assert setup.worker.retiring
    assert setup.answer(command) is None


def test_a_gateway_with_a_later_revision_has_applied_the_change(setup: Setup) -> None:
    command = setup.unload()
    setup.ticks(1)
    setup.gateway("busy", setup.revision() + 3)  # (another change since, applied too)
    setup.settle()
    assert setup.answer(command) is None


def test_with_no_live_gateway_an_unload_waits_for_none(setup: Setup) -> None:
    setup.gateway("dead", setup.revision(), live=False)
    command = setup.unload()
    setup.settle()
    assert setup.worker.retiring
    assert setup.answer(command) is None


def test_a_gateway_that_never_catches_up_holds_the_unload_only_so_long(
    setup: Setup, caplog: pytest.LogCaptureFixture
) -> None:
    setup.gateway("stuck", setup.revision())
    setup.gateway("new", None)  # has not read any catalog yet: it may hold the old one
    command = setup.unload()
    setup.ticks()
    setup.clock[0] += CATCH_UP_S / 2
    setup.ticks()
    assert setup.answer(command) == "none"
    setup.clock[0] += CATCH_UP_S
    with caplog.at_level(logging.WARNING, logger="sluice.up"):
        setup.settle()
    assert setup.answer(command) is None
    warning = next(r.getMessage() for r in caplog.records if "did not report" in r.getMessage())
    assert "new" in warning and "stuck" in warning and "'m'" in warning


def test_versions_a_load_no_longer_serves_wait_for_the_gateways_too(setup: Setup) -> None:
    """The workers of versions a load replaced stop the same way (a rollout that drops a
    version): not before every live gateway applied the catalog without them."""
    control = setup.control
    before = setup.revision()
    setup.gateway("idle", before)
    leaving = Child(ChildSpec("m-2", ["true"], {}))
    model = RepositoryModel("m", Path("m"), None, (2,))
    control.on_change()  # (a load published the catalog without version 2)
    control._draining.append((model, [leaving], control._unpublished()))
    setup.clock[0] += CATCH_UP_S / 2
    setup.ticks()
    assert not leaving.retiring
    setup.gateway("idle", setup.revision())
    setup.settle()
    assert leaving.retiring
    assert not control.busy
