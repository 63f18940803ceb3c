"""A batch job's outputs against its tenant's stored bytes, in a batch worker, on a real
redis-server and a real batch store (the model's answers come from a stand-in for the
feeder):

- a job whose next part would pass the quota stops, whole, with the limit named in its
  status: its other shards no longer compute what could not be written (each used to run
  to the end and fail on its own), the shards it committed stay and count, and nothing
  of the refused one is left, in the store or in the worker's scratch folder;
- a JSON Lines part is counted as its answers are written, and stops before it passes the
  quota (it used to be written whole into the worker's scratch folder first, however
  large, and only then refused);
- a batch removed (expired, or deleted by its tenant) while a shard puts a part counts
  nothing more: the part goes, and the tenant's stored bytes are what they were (they used
  to go below zero: the part was given back a second time, after the removal had given
  back everything the batch counted).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import orjson
import pytest

from sluice.batch.feeder import Feeder
from sluice.batch.runner import Runner
from sluice.core.batch_jobs import batches as b
from sluice.core.batch_jobs.store import LocalTree, open_store
from sluice.core.batch_jobs.sweeper import StoreSweeper
from sluice.core.keys import Keys
from sluice.scheduler.executor.redis_server import RedisServer
from tests.unit.batch.runners import TENANT, make_runner, planned

QUOTA = 1 << 20
PART_BYTES = 128 + 100 * 4 * 4
"""A part of 100 rows of 4 FP32 values, as ``.npy``."""


@pytest.fixture
def runner(
    redis_server: RedisServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Runner]:
    made = make_runner(redis_server, tmp_path, monkeypatch, tenant_max_stored_bytes=QUOTA)
    yield made
    made.close()


def _keys(runner: Runner) -> Keys:
    return Keys(runner.settings.namespace)


def _stored(runner: Runner) -> int:
    return int(runner.redis.get(_keys(runner).stored_bytes(TENANT)) or 0)


def _files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.rglob("*") if p.is_file()) if folder.exists() else []


def _scratch(runner: Runner) -> list[str]:
    return [name for name in _files(runner.storage.scratch) if name != ".lock"]


def test_a_job_past_the_quota_stops_whole_and_keeps_what_it_committed(
    runner: Runner, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    computed: list[int] = []

    def run(self: Feeder, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        computed.append(len(inputs["X"]))
        return {"Y": inputs["X"] * 2}

    monkeypatch.setattr(Feeder, "run", run)
    keys = _keys(runner)
    uploads = QUOTA - PART_BYTES - PART_BYTES // 2  # room for one part and a half
    runner.redis.set(keys.stored_bytes(TENANT), uploads)
    source = tmp_path / "rows.npy"
    np.save(source, np.arange(1200, dtype=np.float32).reshape(300, 4))
    options = b.BatchOptions(shard_rows=100, input_format="npy", output_format="npy")
    batch_id = planned(runner, source, options)
    for index in range(3):
        runner.shard(batch_id, index, True)
    record = runner.record(batch_id)

    assert record[b.F_STATUS] == b.FAILED, record
    assert record[b.F_ERROR].startswith("shard 1: "), record[b.F_ERROR]
    assert f"SLUICE_TENANT_MAX_STORED_BYTES ({QUOTA})" in record[b.F_ERROR]
    assert computed == [100, 100]  # shard 2 did not run: the job had stopped
    states = runner.redis.hgetall(keys.batch_shards(batch_id))
    committed = orjson.loads(states[b"0"])
    assert committed["committed"] and committed["rows"] == [0, 100]
    folder = tmp_path / "store" / TENANT / "batches" / batch_id
    assert _files(folder) == ["part-000000-a1.Y.npy"]
    np.testing.assert_array_equal(
        np.load(folder / "part-000000-a1.Y.npy"),
        np.arange(400, dtype=np.float32).reshape(100, 4) * 2,
    )
    assert _stored(runner) == uploads + PART_BYTES
    assert int(runner.redis.hget(keys.batch_stored(TENANT), batch_id) or 0) == PART_BYTES
    assert _scratch(runner) == []  # nothing of the refused part is left behind


def _line(request_id: str) -> bytes:
    request = {"id": request_id, "inputs": [{"name": "X", "shape": [1, 1], "datatype": "FP32"}]}
    request["inputs"][0]["data"] = [1.0]  # type: ignore[index]
    return json.dumps(request).encode()


def test_a_json_lines_part_stops_before_it_passes_the_quota(
    runner: Runner, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """200 answers of about 80 KB of JSON each (16 MB) against 1 MiB of room: the shard
    stops after a dozen or so of them."""
    monkeypatch.setattr(
        Feeder, "run", lambda self, inputs: {"Y": np.full((1, 1 << 12), 0.123456789, np.float32)}
    )
    source = tmp_path / "requests.jsonl"
    source.write_bytes(b"".join(_line(f"r{i}") + b"\n" for i in range(200)))
    options = b.BatchOptions(input_format="jsonl", output_format="jsonl")
    batch_id = planned(runner, source, options)
    runner.shard(batch_id, 0, True)
    record = runner.record(batch_id)

    assert record[b.F_STATUS] == b.FAILED, record
    assert "SLUICE_TENANT_MAX_STORED_BYTES" in record[b.F_ERROR]
    answered = sum(int(v) for v in runner.redis.hvals(_keys(runner).batch_progress(batch_id)))
    assert 0 < answered < 20, answered
    assert _stored(runner) == 0  # what it counted as it wrote is given back
    assert _files(tmp_path / "store" / TENANT) == []
    assert _scratch(runner) == []


def test_a_batch_removed_while_a_part_is_put_counts_nothing_more(
    runner: Runner, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(Feeder, "run", lambda self, inputs: {"Y": inputs["X"]})
    keys = _keys(runner)
    source = tmp_path / "rows.npy"
    np.save(source, np.ones((100, 4), dtype=np.float32))
    options = b.BatchOptions(input_format="npy", output_format="npy")
    batch_id = planned(runner, source, options)
    sweeper = StoreSweeper(runner.redis, keys, open_store(runner.settings))
    put_file = LocalTree.put_file

    def removed_meanwhile(tree: LocalTree, key: str, source: Path) -> int:
        # Its tenant deletes it (the job ended for it: cancelled) as the part goes in.
        runner.redis.hset(keys.batch(batch_id), b.F_STATUS, b.CANCELLED)
        assert sweeper.remove_batch(TENANT, batch_id, runner.record(batch_id))
        return put_file(tree, key, source)

    monkeypatch.setattr(LocalTree, "put_file", removed_meanwhile)
    runner.shard(batch_id, 0, True)

    assert _stored(runner) == 0
    assert not runner.redis.exists(keys.batch(batch_id))
    assert not runner.redis.hexists(keys.batch_stored(TENANT), batch_id)
    assert _files(tmp_path / "store" / TENANT) == []
    assert _scratch(runner) == []
    assert not sweeper.remove_batch(TENANT, batch_id, {})  # removed once only
