"""The batch routes and a tenant's turns, on a real redis-server (the gateway's routes of
:mod:`tests.unit.gateway.jobs.batch_gateway`; plan tasks read from the broker's queue):

- a job submitted while its tenant has ``SLUICE_TENANT_MAX_RUNNING_BATCHES`` jobs running is
  accepted (201, counted against ``SLUICE_TENANT_MAX_BATCHES``) and waits ``queued`` with
  its place in line, no plan task queued; another tenant's job starts at once;
- a job cancelled or deleted by its tenant gives its turn to the next in line, whose plan
  task the gateway queues;
- a job waiting in line can be cancelled (it never starts), deleted (it goes, its upload
  freed) and resumed (nothing changes: it keeps its place, 200 with its status); a job that
  had ended and is resumed waits in line as a new one does;
- a gateway killed between writing a job ``queued`` (submitted, or resumed after it ended)
  and putting it in its tenant's turns or line does not leave it waiting until its client
  resumes it: the batch workers' periodic round gives it a turn (it starts) or its place."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from sluice.batch.runner import Reaper, Runner
from sluice.core.batch_jobs import batches as b
from sluice.core.batch_jobs.celery_config import queue_name
from sluice.gateway.jobs import batch_routes
from sluice.scheduler.executor.redis_server import RedisServer
from tests.unit.batch.runners import make_runner
from tests.unit.gateway.jobs.batch_gateway import MODEL, BatchGateway, batch_gateway


@pytest.fixture
async def gateway(redis_server: RedisServer, tmp_path: Path) -> AsyncIterator[BatchGateway]:
    async with batch_gateway(
        redis_server.url, tmp_path / "store", tenant_max_running_batches=2, tenant_max_batches=6
    ) as made:
        yield made


async def _get(gateway: BatchGateway, tenant: str, batch_id: str) -> dict[str, Any]:
    async with gateway.client(tenant) as client:
        answer = await client.get(f"/v2/batches/{batch_id}")
    assert answer.status_code == 200, answer.text
    body: dict[str, Any] = answer.json()
    return body


async def _plans(gateway: BatchGateway) -> list[str]:
    """The jobs whose plan tasks wait in the broker's queue, first sent first."""
    queue = gateway.keys.celery_prefix + queue_name(gateway.state.settings.namespace)
    planned = []
    for raw in reversed(await gateway.redis.lrange(queue, 0, -1)):  # (LPUSHed)
        headers = json.loads(raw)["headers"]
        if headers["task"] == b.PLAN_TASK:
            planned.append(headers["argsrepr"].split("'")[1])
    return planned


async def test_jobs_beyond_the_bound_wait_in_line_and_start_as_others_end(
    gateway: BatchGateway,
) -> None:
    upload_id = await gateway.upload("team-a")
    jobs = [await gateway.submit("team-a", upload_id) for _ in range(5)]
    ids = [job["id"] for job in jobs]
    assert [job["status"] for job in jobs] == [b.PLANNING] * 2 + [b.QUEUED] * 3
    assert [job.get("place") for job in jobs] == [None, None, 1, 2, 3]
    assert await _plans(gateway) == ids[:2]
    # Another tenant's job starts at once.
    theirs = await gateway.submit("team-b", await gateway.upload("team-b"))
    assert theirs["status"] == b.PLANNING and "place" not in theirs
    assert await _plans(gateway) == [*ids[:2], theirs["id"]]

    async with gateway.client("team-a") as client:
        # Resuming a waiting job changes nothing.
        resumed = await client.post(f"/v2/batches/{ids[3]}/resume")
        assert resumed.status_code == 200, resumed.text
        assert resumed.json()["status"] == b.QUEUED and resumed.json()["place"] == 2
        # Cancelling a running one gives its turn to the first in line.
        cancelled = await client.post(f"/v2/batches/{ids[0]}/cancel")
        assert cancelled.json()["status"] == b.CANCELLED
        assert (await _get(gateway, "team-a", ids[2]))["status"] == b.PLANNING
        assert await _plans(gateway) == [*ids[:2], theirs["id"], ids[2]]
        assert (await _get(gateway, "team-a", ids[3]))["place"] == 1
        assert (await _get(gateway, "team-a", ids[4]))["place"] == 2

        # A waiting job cancelled never starts, and leaves the line.
        cancelled = await client.post(f"/v2/batches/{ids[3]}/cancel")
        assert cancelled.json()["status"] == b.CANCELLED and "place" not in cancelled.json()
        assert (await _get(gateway, "team-a", ids[4]))["place"] == 1
        # A waiting job deleted goes, and frees its upload.
        assert (await client.delete(f"/v2/batches/{ids[4]}")).status_code == 204
        assert (await client.get(f"/v2/batches/{ids[4]}")).status_code == 404
        users = await gateway.redis.hget(gateway.keys.upload("team-a", upload_id), "users")
        assert users == b"4"  # (ids 0 to 3)

        # A job that had ended and is resumed waits in line as a new one does.
        resumed = await client.post(f"/v2/batches/{ids[3]}/resume")
        assert resumed.status_code == 200, resumed.text
        assert resumed.json()["status"] == b.QUEUED and resumed.json()["place"] == 1
        # Deleting a job that ended gives no turn (it held none); one that is running: 409.
        assert (await client.delete(f"/v2/batches/{ids[0]}")).status_code == 204
        assert (await _get(gateway, "team-a", ids[3]))["status"] == b.QUEUED
        assert (await client.delete(f"/v2/batches/{ids[1]}")).status_code == 409
        # The job running ends (as a batch worker ends it, here by its cancel): the
        # resumed one starts, as a resume (its plan task resumes it).
        await client.post(f"/v2/batches/{ids[1]}/cancel")
    assert (await _get(gateway, "team-a", ids[3]))["status"] == b.PLANNING
    assert (await _plans(gateway))[-1] == ids[3]
    line = gateway.keys.tenant_queued_batches("team-a")
    assert await gateway.redis.zcard(line) == 0
    running = await gateway.redis.zrange(gateway.keys.tenant_running_batches("team-a"), 0, -1)
    assert {raw.decode() for raw in running} == {ids[2], ids[3]}


async def test_waiting_jobs_count_against_the_tenants_max_batches(
    gateway: BatchGateway,
) -> None:
    upload_id = await gateway.upload("team-a")
    for _ in range(6):
        await gateway.submit("team-a", upload_id)
    async with gateway.client("team-a") as client:
        refused = await client.post(
            "/v2/batches", json={"model": MODEL, "input": f"upload:{upload_id}"}
        )
    assert refused.status_code == 429, refused.text
    assert "SLUICE_TENANT_MAX_BATCHES" in refused.json()["error"]


class Killed(Exception):
    """The gateway process stops here."""


async def _killed(*args: object) -> bool:
    raise Killed


@pytest.mark.parametrize("route", ["submit", "resume"])
async def test_a_job_whose_gateway_was_killed_before_it_took_its_turn_starts_all_the_same(
    gateway: BatchGateway,
    redis_server: RedisServer,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    route: str,
) -> None:
    """The job is written ``queued`` (or resumed so), and the gateway is killed before it
    takes a turn or a place in line (nor does it undo anything, killed)."""
    plans: list[str] = []
    runner: Runner = make_runner(
        redis_server,
        tmp_path,
        monkeypatch,
        namespace=gateway.state.settings.namespace,
        on_plan=plans.append,
        tenant_max_running_batches=2,
    )
    try:
        upload_id = await gateway.upload("team-a")
        running = (await gateway.submit("team-a", upload_id))["id"]
        lost: list[str] = []
        async with gateway.client("team-a") as client:
            for _ in range(2):  # the first gets the free turn, the second waits in line
                if route == "resume":
                    batch_id = (await gateway.submit("team-a", upload_id))["id"]
                    await client.post(f"/v2/batches/{batch_id}/cancel")
                with monkeypatch.context() as killed:
                    killed.setattr(batch_routes, "_take_turn", _killed)
                    killed.setattr(batch_routes, "_undo", _killed)
                    with pytest.raises(Killed):
                        if route == "resume":
                            await client.post(f"/v2/batches/{batch_id}/resume")
                        else:
                            body = {"model": MODEL, "input": f"upload:{upload_id}"}
                            await client.post("/v2/batches", json=body)
                if route == "submit":
                    listed = await client.get("/v2/batches")
                    batch_id = listed.json()["batches"][0]["id"]
                lost.append(batch_id)
        for batch_id in lost:
            job = await _get(gateway, "team-a", batch_id)
            assert job["status"] == b.QUEUED and "place" not in job
        turns = gateway.keys.tenant_running_batches("team-a")
        assert await gateway.redis.zcard(turns) == 1

        Reaper(runner).sweep()
        assert (await _get(gateway, "team-a", lost[0]))["status"] == b.PLANNING
        if route == "submit":
            assert plans == [lost[0]]  # (its plan task, sent by the round)
        else:  # (the one queued as it was first submitted, not run yet, resumes it)
            assert plans == [] and lost[0] in await _plans(gateway)
        assert (await _get(gateway, "team-a", lost[1]))["place"] == 1
        # The running one ends: the one in line takes its turn, as any waiting job does.
        async with gateway.client("team-a") as client:
            await client.post(f"/v2/batches/{running}/cancel")
        assert (await _get(gateway, "team-a", lost[1]))["status"] == b.PLANNING
        assert not await gateway.redis.exists(gateway.keys.tenant_admitting_batches("team-a"))
    finally:
        runner.close()
