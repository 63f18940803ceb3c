"""``GET /v2/jobs/{id}/result`` with ``Prefer: wait=N`` (long polling), on a real
redis-server: a client that goes away while it waits stops the polling for it. Before, the
route polled Redis for the job up to ``SLUICE_MAX_JOB_WAIT_S`` for nobody, so a client that
opened and dropped connections in a loop left ever more pollers behind (beyond the
gateway's bound on open connections)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace

import orjson
import pytest
from starlette.requests import Request

from sluice.gateway.http.guard import TENANT_STATE
from sluice.gateway.http.protocol import CANCEL_ON_DISCONNECT
from sluice.gateway.jobs import async_jobs, job_routes
from sluice.gateway.jobs.async_jobs import submit_job
from sluice.scheduler.executor.redis_server import RedisServer
from tests.unit.gateway.jobs.batch_gateway import MODEL, batch_gateway

BODY = orjson.dumps(
    {"inputs": [{"name": "IN_FP32", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}]}
)


async def test_a_long_poll_whose_client_went_away_stops_polling(
    redis_server: RedisServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with batch_gateway(redis_server.url, tmp_path) as gateway:
        job_id = (await submit_job(gateway.state, MODEL, None, BODY, None, owner="team-a")).job_id
        polls = 0
        read = async_jobs.job_record

        async def counted(*args: object) -> dict[str, bytes]:
            nonlocal polls
            polls += 1
            return await read(*args)  # type: ignore[arg-type]

        monkeypatch.setattr(async_jobs, "job_record", counted)
        scope = {
            "type": "http",
            "method": "GET",
            "path": f"/v2/jobs/{job_id}/result",
            "headers": [(b"prefer", b"wait=30")],
            "query_string": b"",
            "app": SimpleNamespace(state=SimpleNamespace(sluice=gateway.state)),
            "state": {TENANT_STATE: "team-a"},
        }
        task = asyncio.create_task(job_routes.get_result(job_id, Request(scope)))
        await asyncio.sleep(0.2)
        assert polls > 0  # (the job is queued: no worker takes it here)
        # What the HTTP protocol does when the connection is lost before the response starts.
        assert scope.get(CANCEL_ON_DISCONNECT) is task
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        after = polls
        await asyncio.sleep(0.2)
        assert polls == after
