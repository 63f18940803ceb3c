"""What ``sluice up`` loads at start in explicit mode, against a real Redis: alone, the
load records of earlier executors are cleared (and replaced by those of its snapshot), so
that a host joining later does not take a configuration nobody serves any more."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from redis import Redis

from sluice.core.catalog import CatalogEntry, encode_entry
from sluice.core.control import REGISTER_EXECUTOR, ControlCommand
from sluice.core.keys import Keys
from sluice.core.repository import scan_repository
from sluice.core.settings import UpSettings
from sluice.scheduler.executor.loaded_as import remember_load
from sluice.scheduler.executor.redis_server import RedisServer
from sluice.scheduler.executor.snapshot import Snapshots
from sluice.scheduler.executor.start_loads import StartLoads, known_to_others
from tests.support.onnx_models import write_identity


@pytest.fixture
def client(redis_server: RedisServer) -> Iterator[Redis]:
    with Redis.from_url(redis_server.url) as redis:
        yield redis


def start(client: Redis, keys: Keys, tmp_path: Path, snapshots: Snapshots | None) -> list[str]:
    repository = tmp_path / "repository"
    settings = UpSettings(model_repository=(str(repository),), load_model=["plain"])
    loads = StartLoads(client, keys, settings, repository, tmp_path / "staging")
    return [m.name for m in loads.choose(scan_repository(repository), snapshots)]


def test_alone_the_records_of_earlier_executors_are_cleared(tmp_path: Path, client: Redis) -> None:
    keys = Keys(f"t{uuid.uuid4().hex[:8]}")
    for name in ("plain", "tuned"):
        write_identity(tmp_path / "repository", name, ["FP32"])
    remember_load(client, keys, ControlCommand("load", "plain", config="{}"))  # (stale)
    assert start(client, keys, tmp_path, None) == ["plain"]
    assert client.hlen(keys.loaded_as) == 0

    snapshots = Snapshots(tmp_path / "snapshots")
    snapshots.save(["tuned"], ControlCommand("load", "tuned", versions=(1,)))
    remember_load(client, keys, ControlCommand("load", "plain", config="{}"))  # (stale)
    assert sorted(start(client, keys, tmp_path, snapshots)) == ["plain", "tuned"]
    assert client.hkeys(keys.loaded_as) == [b"tuned"]  # (the snapshot's, for joiners)


def test_joining_the_snapshot_takes_how_the_others_loaded_each_model(
    tmp_path: Path, client: Redis
) -> None:
    """The models of a joining executor are the others', each as they loaded it: its
    snapshot says so too, else its next start alone restores how it had loaded them before
    (a configuration nobody serves any more)."""
    keys = Keys(f"t{uuid.uuid4().hex[:8]}")
    for name in ("plain", "tuned", "rolled"):
        write_identity(tmp_path / "repository", name, ["FP32"])
    snapshots = Snapshots(tmp_path / "snapshots")
    snapshots.save(["tuned"], ControlCommand("load", "tuned", versions=(1,)))
    snapshots.save(["tuned", "rolled"], ControlCommand("load", "rolled", versions=(1,)))
    client.eval(REGISTER_EXECUTOR, 1, keys.executors, "other-host", 60)
    for model in scan_repository(tmp_path / "repository"):
        entry = CatalogEntry(model.name, model.versions, model.config)
        client.hset(keys.catalog, model.name, encode_entry(entry))
    remember_load(client, keys, ControlCommand("load", "rolled", versions=(1,)))
    remember_load(client, keys, ControlCommand("load", "plain", config="{}"))
    client.hdel(keys.catalog, "plain")  # (recorded, but not loaded)

    assert sorted(start(client, keys, tmp_path, snapshots)) == ["plain", "rolled", "tuned"]
    restored = snapshots.restore()
    assert restored is not None
    assert restored[0] == {"plain", "rolled", "tuned"}
    assert {name: c.versions for name, c in restored[1].items()} == {"rolled": (1,)}


def test_joining_the_executor_knows_the_models_the_others_know(client: Redis) -> None:
    """With model namespacing a model loaded once, then unloaded, is answered otherwise
    than one never loaded: an executor that joins (a restart beside the others) publishes
    the catalog knowing what they know, not as if nothing was ever loaded. Alone, it starts
    afresh, as Triton does."""
    keys = Keys(f"t{uuid.uuid4().hex[:8]}")
    entries = [
        CatalogEntry("gone", (), None, "unloaded", once_loaded=True),
        CatalogEntry("never", (), None, "unloaded"),
    ]
    for entry in entries:
        client.hset(keys.catalog, entry.name, encode_entry(entry))
    assert known_to_others(client, keys) == set()
    client.eval(REGISTER_EXECUTOR, 1, keys.executors, "other-host", 60)
    assert known_to_others(client, keys) == {"gone"}
