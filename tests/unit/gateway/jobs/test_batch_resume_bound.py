"""Resuming a batch job against a client that resumes in a loop, on a real redis-server
(the gateway's routes of :mod:`tests.unit.gateway.jobs.batch_gateway` and a batch worker's
runner in the same namespace):

- a running job has at most one resume waiting for a batch worker: every resume queued a
  plan task that sent every shard not committed again (up to 100,000 messages each), so a
  tenant resuming in a loop filled Redis up to its high-water mark, and every tenant's new
  work was refused; a resume while one waits answers as that one will (200, the job);
- the resume a batch worker runs sends again only the shards that are really lost, not
  those a live lease shows being computed; once it has run, the job can be resumed again;
- ``options.input_name`` is checked at submission against the model's inputs (400 naming
  the field and the inputs), not only once the job runs (any string was taken, NUL
  included, and the job failed later)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from sluice.core.batch_jobs import batches as b
from sluice.core.batch_jobs.celery_config import queue_name
from sluice.scheduler.executor.redis_server import RedisServer
from tests.unit.batch.runners import make_runner
from tests.unit.gateway.jobs.batch_gateway import MODEL, BatchGateway, batch_gateway


@pytest.fixture
async def gateway(redis_server: RedisServer, tmp_path: Path) -> AsyncIterator[BatchGateway]:
    async with batch_gateway(redis_server.url, tmp_path / "store") as made:
        yield made


async def _submit(gateway: BatchGateway, name: str = "rows.jsonl", **options: object) -> str:
    """A job of team-a over a new upload named ``name``; its id."""
    async with gateway.client("team-a") as client:
        uploaded = await client.post(f"/v2/uploads?name={name}", content=b"{}\n")
        assert uploaded.status_code == 201, uploaded.text
        body = {"model": MODEL, "input": f"upload:{uploaded.json()['id']}", "options": options}
        answer = await client.post("/v2/batches", json=body)
    assert answer.status_code == 201, answer.text
    batch_id: str = answer.json()["id"]
    return batch_id


async def _queued_resumes(gateway: BatchGateway, batch_id: str) -> int:
    """The plan tasks of ``batch_id`` that resume it, waiting in the broker's queue."""
    queue = gateway.keys.celery_prefix + queue_name(gateway.state.settings.namespace)
    count = 0
    for raw in await gateway.redis.lrange(queue, 0, -1):
        headers = json.loads(raw)["headers"]
        if headers["task"] == b.PLAN_TASK and headers["argsrepr"] == repr([batch_id, True]):
            count += 1
    return count


async def test_resumes_in_a_loop_queue_one_plan_that_sends_only_lost_shards(
    gateway: BatchGateway,
    redis_server: RedisServer,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    batch_id = await _submit(gateway)
    keys, redis = gateway.keys, gateway.redis
    # Planned into 4 shards: 0 committed, 1 computed now (its lease live), 2 lost (its
    # worker died: the lease ran out), 3 never taken.
    await redis.hset(
        keys.batch(batch_id), mapping={b.F_STATUS: b.RUNNING, b.F_SHARDS: 4, b.F_SHARDS_DONE: 1}
    )
    await redis.hset(keys.batch_shards(batch_id), "0", '{"committed": true, "rows": [0, 1]}')
    now = time.time()
    await redis.hset(keys.batch_leases(batch_id), mapping={"1": now + 60, "2": now - 60})
    await redis.hset(keys.batch_attempts(batch_id), mapping={"0": 1, "1": 1, "2": 1})

    async with gateway.client("team-a") as client:
        answers = await asyncio.gather(
            *(client.post(f"/v2/batches/{batch_id}/resume") for _ in range(50))
        )
    assert {answer.status_code for answer in answers} == {200}, answers[0].text
    assert {answer.json()["status"] for answer in answers} == {b.RUNNING}
    assert await _queued_resumes(gateway, batch_id) == 1

    sent: list[int] = []
    runner = make_runner(
        redis_server,
        tmp_path,
        monkeypatch,
        on_shard=lambda _, index: sent.append(index),
        namespace=gateway.state.settings.namespace,
    )
    try:
        await asyncio.to_thread(runner.plan, batch_id, True)  # the queued resume runs
    finally:
        runner.close()
    assert sorted(sent) == [2, 3]  # not 1, which its worker is computing

    async with gateway.client("team-a") as client:
        again = await client.post(f"/v2/batches/{batch_id}/resume")
    assert again.status_code == 200, again.text
    assert await _queued_resumes(gateway, batch_id) == 2


async def test_a_resume_whose_plan_was_lost_no_longer_holds_back_the_next(
    gateway: BatchGateway,
) -> None:
    batch_id = await _submit(gateway)
    key = gateway.keys.batch(batch_id)
    await gateway.redis.hset(key, mapping={b.F_STATUS: b.RUNNING, b.F_SHARDS: 1})
    async with gateway.client("team-a") as client:
        assert (await client.post(f"/v2/batches/{batch_id}/resume")).status_code == 200
        assert await _queued_resumes(gateway, batch_id) == 1
        queued_at = float(await gateway.redis.hget(key, b.F_RESUME_QUEUED) or 0)
        await gateway.redis.hset(key, b.F_RESUME_QUEUED, queued_at - b.RESUME_QUEUED_S - 1)
        assert (await client.post(f"/v2/batches/{batch_id}/resume")).status_code == 200
    assert await _queued_resumes(gateway, batch_id) == 2


@pytest.mark.parametrize("input_name", ["NOPE", "IN_FP32\0", "x" * 256])
async def test_an_input_name_the_model_does_not_have_is_refused_at_submission(
    gateway: BatchGateway, input_name: str
) -> None:
    async with gateway.client("team-a") as client:
        uploaded = await client.post("/v2/uploads?name=rows.npy", content=b"rows")
        body = {
            "model": MODEL,
            "input": f"upload:{uploaded.json()['id']}",
            "options": {"input_name": input_name},
        }
        answer = await client.post("/v2/batches", json=body)
        assert answer.status_code == 400, answer.text
        error = answer.json()["error"]
        assert "'options.input_name'" in error and "IN_FP32" in error
        assert (await client.get("/v2/batches")).json() == {"batches": []}
    await _submit(gateway, "rows.npy", input_name="IN_FP32")  # the model's input is taken
