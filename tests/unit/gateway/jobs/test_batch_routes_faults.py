"""The upload and batch routes against races, faults and floods, on a real redis-server
(:mod:`tests.unit.gateway.jobs.batch_gateway`):

- a cancel that lands as the job completes never turns the completed job into a cancelled
  one (its outputs hidden), and a resume that lands then never runs it again;
- a job whose planning task cannot be queued (the broker out of reach) is not left
  ``planning`` for ever, holding its upload (which could then neither expire nor be
  deleted): the client gets 503 saying why, and nothing of the job stays;
- one tenant cannot fill Redis with uploads (an empty one cost nothing against the stored
  bytes quota) or batch jobs: each is bounded per tenant, with 429 naming the setting, and
  another tenant is not affected;
- a batch of as many shards as its client's ``shard_rows`` makes is summed up for its
  status on a thread, never on the event loop."""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import orjson
import pytest

from sluice.core.batch_jobs import batches as b
from sluice.gateway.jobs import batch_routes
from sluice.scheduler.executor.redis_server import RedisServer, free_port
from tests.unit.gateway.jobs.batch_gateway import MODEL, BatchGateway, batch_gateway


@pytest.fixture
async def gateway(redis_server: RedisServer, tmp_path: Path) -> AsyncIterator[BatchGateway]:
    async with batch_gateway(redis_server.url, tmp_path) as made:
        yield made


async def _status(gateway: BatchGateway, batch_id: str) -> str:
    raw = await gateway.redis.hget(gateway.keys.batch(batch_id), b.F_STATUS)
    assert raw is not None
    return str(raw.decode())


@pytest.mark.parametrize("route", ["cancel", "resume"])
async def test_a_cancel_or_resume_that_races_completion_leaves_the_job_completed(
    gateway: BatchGateway, monkeypatch: pytest.MonkeyPatch, route: str
) -> None:
    batch_id = (await gateway.submit("team-a", await gateway.upload("team-a")))["id"]
    await gateway.redis.hset(gateway.keys.batch(batch_id), b.F_STATUS, b.RUNNING)
    read = batch_routes._record

    async def completed_meanwhile(*args: Any) -> dict[str, str]:
        """The route has read the job (running); the batch worker's end lands now."""
        record = await read(*args)
        await gateway.redis.hset(
            gateway.keys.batch(batch_id),
            mapping={b.F_STATUS: b.COMPLETED, b.F_FILES: '[{"name": "_manifest.json"}]'},
        )
        monkeypatch.setattr(batch_routes, "_record", read)
        return record

    monkeypatch.setattr(batch_routes, "_record", completed_meanwhile)
    async with gateway.client("team-a") as client:
        answer = await client.post(f"/v2/batches/{batch_id}/{route}")
        assert await _status(gateway, batch_id) == b.COMPLETED
        if route == "cancel":
            assert answer.status_code == 200 and answer.json()["status"] == b.COMPLETED
        else:
            assert answer.status_code == 400 and "complete" in answer.json()["error"]
        listed = await client.get(f"/v2/batches/{batch_id}/outputs")
        assert listed.status_code == 200, listed.text


async def test_a_job_whose_plan_cannot_be_queued_leaves_nothing_and_frees_its_upload(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    broker = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    async with batch_gateway(redis_server.url, tmp_path, batch_broker_url=broker) as gateway:
        upload_id = await gateway.upload("team-a")
        async with gateway.client("team-a") as client:
            answer = await client.post(
                "/v2/batches", json={"model": MODEL, "input": f"upload:{upload_id}"}
            )
            assert answer.status_code == 503, answer.text
            assert "could not be queued" in answer.json()["error"]
            assert int(answer.headers["retry-after"]) > 0
            assert (await client.get("/v2/batches")).json() == {"batches": []}
            assert (await client.get(f"/v2/uploads/{upload_id}")).json()["in_use"] is False
            assert (await client.delete(f"/v2/uploads/{upload_id}")).status_code == 204
        assert await gateway.redis.zcard(gateway.keys.store_expiry) == 0
        assert await gateway.redis.zcard(gateway.keys.batches("team-a")) == 0

        # A failed job resumed then: it stays failed (saying why), and still expires.
        batch_id = "f" * 32
        await gateway.redis.hset(
            gateway.keys.batch(batch_id),
            mapping={b.F_STATUS: b.FAILED, b.F_OWNER: "team-a", b.F_SHARDS: 1},
        )
        async with gateway.client("team-a") as client:
            answer = await client.post(f"/v2/batches/{batch_id}/resume")
            assert answer.status_code == 503, answer.text
        assert await _status(gateway, batch_id) == b.FAILED
        error = await gateway.redis.hget(gateway.keys.batch(batch_id), b.F_ERROR)
        assert error is not None and b"could not be queued" in error
        member = f"batch:team-a:{batch_id}"
        assert await gateway.redis.zscore(gateway.keys.store_expiry, member) is not None


async def test_uploads_per_tenant_are_bounded_even_empty_ones(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    async with batch_gateway(redis_server.url, tmp_path, tenant_max_uploads=3) as gateway:
        kept = [await gateway.upload("team-a", b"") for _ in range(3)]
        async with gateway.client("team-a") as a:
            refused = await a.post("/v2/uploads?name=rows.jsonl", content=b"")
            assert refused.status_code == 429, refused.text
            assert "SLUICE_TENANT_MAX_UPLOADS" in refused.json()["error"]
            assert int(refused.headers["retry-after"]) > 0
            assert len((await a.get("/v2/uploads")).json()["uploads"]) == 3
            await gateway.upload("team-b", b"")  # another tenant's room is its own
            assert (await a.delete(f"/v2/uploads/{kept[0]}")).status_code == 204
        await gateway.upload("team-a", b"")
        files = list((tmp_path / "team-a" / "uploads").iterdir())
        assert len(files) == 3, files


async def test_batch_jobs_per_tenant_are_bounded(redis_server: RedisServer, tmp_path: Path) -> None:
    async with batch_gateway(redis_server.url, tmp_path, tenant_max_batches=2) as gateway:
        upload_id = await gateway.upload("team-a")
        for _ in range(2):
            await gateway.submit("team-a", upload_id)
        async with gateway.client("team-a") as a:
            refused = await a.post(
                "/v2/batches", json={"model": MODEL, "input": f"upload:{upload_id}"}
            )
            assert refused.status_code == 429, refused.text
            assert "SLUICE_TENANT_MAX_BATCHES" in refused.json()["error"]
            assert int(refused.headers["retry-after"]) > 0
            assert len((await a.get("/v2/batches")).json()["batches"]) == 2
            upload = (await a.get(f"/v2/uploads/{upload_id}")).json()
            assert upload["in_use"] is True
        users = await gateway.redis.hget(gateway.keys.upload("team-a", upload_id), "users")
        assert users == b"2"  # the refused job does not hold the upload
        await gateway.submit("team-b", await gateway.upload("team-b"))


async def test_a_batch_of_many_shards_is_summed_up_off_the_event_loop(
    gateway: BatchGateway, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client's ``shard_rows`` decides how many shards a batch has (up to
    ``MAX_SHARDS``): reading their states for ``GET /v2/batches/{id}`` is work proportional
    to them, done on a thread, never on the event loop; what it shows is bounded."""
    batch_id = (await gateway.submit("team-a", await gateway.upload("team-a")))["id"]
    shards = 2000
    states = {
        str(i): orjson.dumps(
            {"error": f"shard {i} broke", "attempt": 1}
            if i % 2
            else {"committed": True, "rows": [i, i + 1], "rows_failed": 1, "row_errors": [i]}
        )
        for i in range(shards)
    }
    await gateway.redis.hset(gateway.keys.batch_shards(batch_id), mapping=states)  # type: ignore[arg-type]
    await gateway.redis.hset(
        gateway.keys.batch_progress(batch_id), mapping={str(i): 1 for i in range(shards)}
    )
    await gateway.redis.hset(gateway.keys.batch(batch_id), b.F_ROWS_TOTAL, shards)
    loop_thread = threading.current_thread()
    parsed_on: set[threading.Thread] = set()

    def loads(raw: bytes) -> Any:
        parsed_on.add(threading.current_thread())
        return orjson.loads(raw)

    monkeypatch.setattr(batch_routes, "orjson", SimpleNamespace(loads=loads, dumps=orjson.dumps))
    async with gateway.client("team-a") as client:
        answer = await client.get(f"/v2/batches/{batch_id}")
    assert answer.status_code == 200, answer.text
    status = answer.json()
    assert status["rows_done"] == shards
    assert status["errors"][:2] == [
        {"shard": 1, "error": "shard 1 broke"},
        {"shard": 3, "error": "shard 3 broke"},
    ]
    assert len(status["errors"]) == len(status["row_errors"]) == 20
    assert status["rows_failed"] == shards // 2
    assert parsed_on and loop_thread not in parsed_on
