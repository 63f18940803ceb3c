"""A batch worker's shard of JSON Lines, on a real redis-server and a real batch store (the
model's answers come from a stand-in for the feeder):

- one bad row fails that row, not the batch: a line that is not JSON, one the model does
  not take, or one the model answers with an error gets the v2 error response in its place
  in the output, the other rows their answers, and the job completes reporting which rows
  failed and why (it used to fail the whole shard, and so the job, for good: resuming it
  met the same line again);
- a shard's answers go to its part file as they come, not held in memory for the whole
  shard (65,536 answers by default, each as large as the model makes it);
- a shard's rows, which a batch worker holds at once with their outputs, are bounded in
  bytes (SLUICE_BATCH_MAX_SHARD_BYTES): 65,536 image rows, or a client's
  ``options.shard_rows`` of 100 million, used to be read whole into memory;
- a part is counted against its tenant's stored bytes before it is put, and refused past
  the quota (it used to be checked only against the bytes counted before it, so a job
  could pass the quota by its last shard's parts and its joined outputs)."""

from __future__ import annotations

import json
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest
from redis import Redis

from sluice.batch.feeder import Feeder, RequestFailed
from sluice.batch.runner import Runner
from sluice.core.batch_jobs import batches as b
from sluice.core.keys import Keys
from sluice.scheduler.executor.redis_server import RedisServer
from tests.unit.batch.runners import TENANT, make_runner, model_config, planned


def _line(request_id: str, values: list[Any], datatype: str = "FP32") -> bytes:
    request = {
        "id": request_id,
        "inputs": [{"name": "X", "shape": [1, len(values)], "datatype": datatype, "data": values}],
    }
    return json.dumps(request).encode()


@pytest.fixture
def runner(
    redis_server: RedisServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Runner]:
    made = make_runner(redis_server, tmp_path, monkeypatch)
    yield made
    made.close()


def _run_job(runner: Runner, redis: Redis, source: Path) -> tuple[str, dict[str, str]]:
    """Plan a JSON Lines job over ``source`` and run its one shard; (id, record)."""
    options = b.BatchOptions(input_format="jsonl", output_format="jsonl")
    batch_id = planned(runner, source, options)
    runner.shard(batch_id, 0, True)
    return batch_id, runner.record(batch_id)


def _output_lines(store: Path, batch_id: str) -> list[dict[str, Any]]:
    folder = store / TENANT / "batches" / batch_id
    manifest = json.loads((folder / b.MANIFEST).read_text())
    return [
        json.loads(line)
        for part in manifest["parts"]
        for line in (folder / part["files"][""]).read_text().splitlines()
    ]


def test_a_bad_row_fails_that_row_alone_and_is_reported(
    runner: Runner, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def run(self: Feeder, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if float(inputs["X"][0, 0]) == 666:
            raise RequestFailed("rows 0..0: the model cannot take 666", "cannot take 666")
        return {"Y": inputs["X"] * 2}

    monkeypatch.setattr(Feeder, "run", run)
    source = tmp_path / "requests.jsonl"
    source.write_bytes(
        b"\n".join(
            [
                _line("r1", [1, 2]),
                b"{not json",
                _line("r3", ["a", "b"]),
                _line("r4", [666.0]),
                _line("r5", [3], "INT64"),
                _line("r6", [4]),
            ]
        )
        + b"\n"
    )
    redis = runner.redis
    batch_id, record = _run_job(runner, redis, source)
    assert record[b.F_STATUS] == b.COMPLETED, record
    answers = _output_lines(tmp_path / "store", batch_id)
    assert [a.get("id") for a in answers] == ["r1", None, "r3", "r4", "r5", "r6"]
    assert answers[0]["outputs"][0]["data"] == [2.0, 4.0]
    assert answers[5]["outputs"][0]["data"] == [8.0]
    assert answers[1]["error"].startswith("'input' line 2: not JSON")
    assert "'input' line 3: input 'X'" in answers[2]["error"]
    assert answers[3]["error"] == "'input' line 4: cannot take 666"
    assert "takes FP32" in answers[4]["error"]
    for failed in answers[1:5]:
        assert "outputs" not in failed and failed["model_name"] == "m"
    state = orjson.loads(redis.hget(Keys(runner.settings.namespace).batch_shards(batch_id), "0"))
    assert state["rows_failed"] == 4
    assert [e["line"] for e in state["row_errors"]] == [2, 3, 4, 5]
    manifest = json.loads(
        (tmp_path / "store" / TENANT / "batches" / batch_id / b.MANIFEST).read_text()
    )
    assert manifest["rows_failed"] == 4
    progress = redis.hvals(Keys(runner.settings.namespace).batch_progress(batch_id))
    assert sum(int(v) for v in progress) == 6  # (lines, the job's rows)


def test_a_shards_answers_are_written_as_they_come(
    runner: Runner, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """120 answers of about 330 KB of JSON each: held together, about 40 MB (written as
    they come, the peak is about 9 MB)."""
    width = 1 << 14

    def run(self: Feeder, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {"Y": np.full((1, width), 0.123456789, dtype=np.float32)}

    monkeypatch.setattr(Feeder, "run", run)
    source = tmp_path / "requests.jsonl"
    source.write_bytes(b"".join(_line(f"r{i}", [1.0]) + b"\n" for i in range(120)))
    tracemalloc.start()
    try:
        batch_id, record = _run_job(runner, runner.redis, source)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert record[b.F_STATUS] == b.COMPLETED, record
    assert peak < 20 << 20, f"{peak} bytes at the peak"
    assert len(_output_lines(tmp_path / "store", batch_id)) == 120


def test_a_shard_holds_a_bounded_number_of_bytes(
    redis_server: RedisServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sent: list[int] = []
    runner = make_runner(
        redis_server,
        tmp_path,
        monkeypatch,
        model_config("4096"),
        lambda batch_id, index: sent.append(index),
        batch_max_shard_bytes=256 << 10,
    )
    source = tmp_path / "rows.npy"
    np.save(source, np.zeros((200, 4096), dtype=np.float64))  # 32 KiB a row, as it is read
    options = b.BatchOptions(shard_rows=100_000_000, input_format="npy", output_format="npy")
    try:
        batch_id = planned(runner, source, options)
        record = runner.record(batch_id)
    finally:
        runner.close()
    # A row: 32 KiB read, 16 KiB converted to FP32, 16 KiB of output: 4 rows in 256 KiB.
    assert json.loads(record[b.F_OPTIONS])["shard_rows"] == 4
    assert record[b.F_SHARDS] == "50"
    assert sent == list(range(runner.settings.batch_shards_in_flight))  # (the others later)


def test_a_part_past_the_stored_bytes_quota_is_refused_before_it_is_put(
    redis_server: RedisServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    quota = 1 << 20
    runner = make_runner(
        redis_server, tmp_path, monkeypatch, model_config("4"), tenant_max_stored_bytes=quota
    )
    monkeypatch.setattr(Feeder, "run", lambda self, inputs: {"Y": inputs["X"]})
    keys = Keys(runner.settings.namespace)
    runner.redis.set(keys.stored_bytes(TENANT), quota - 1000)  # its parts: 1,728 bytes
    source = tmp_path / "rows.npy"
    np.save(source, np.ones((100, 4), dtype=np.float32))
    options = b.BatchOptions(input_format="npy", output_format="npy")
    try:
        batch_id = planned(runner, source, options)
        runner.shard(batch_id, 0, True)
        record = runner.record(batch_id)
        stored = int(runner.redis.get(keys.stored_bytes(TENANT)) or 0)
    finally:
        runner.close()
    assert record[b.F_STATUS] == b.FAILED, record
    assert "SLUICE_TENANT_MAX_STORED_BYTES" in record[b.F_ERROR]
    assert stored == quota - 1000
    folder = tmp_path / "store" / TENANT / "batches" / batch_id
    assert not folder.exists() or not [p for p in folder.rglob("*") if p.is_file()]
