"""Asynchronous job submissions that create no job leave nothing in Redis, on a real
redis-server: a submission refused by a limit (429 / 503), or one that finds the earlier job
of its idempotency key, used to leave its would-be job's id -> model record behind for the
job's whole possible life (two days by default), so a client hammering a full queue, or
repeating one request, filled Redis with records of jobs that never were."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from sluice.core.errors import QuotaExceeded
from sluice.gateway.jobs.async_jobs import submit_job
from sluice.scheduler.executor.redis_server import RedisServer
from tests.unit.gateway.jobs.batch_gateway import MODEL, batch_gateway

BODY = orjson.dumps(
    {"inputs": [{"name": "IN_FP32", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}]}
)


async def test_submissions_that_create_no_job_leave_no_record(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    async with batch_gateway(redis_server.url, tmp_path, tenant_max_queued_jobs=1) as gateway:
        created = await submit_job(gateway.state, MODEL, None, BODY, None, owner="team-a")
        assert created.created
        for _ in range(5):
            with pytest.raises(QuotaExceeded):
                await submit_job(gateway.state, MODEL, None, BODY, None, owner="team-a")
        keyed = [
            await submit_job(
                gateway.state, MODEL, None, BODY, None, owner="team-b", idempotency_key="k"
            )
            for _ in range(3)
        ]
        assert [s.created for s in keyed] == [True, False, False]
        assert len({s.job_id for s in keyed}) == 1
        records = [k async for k in gateway.redis.scan_iter(gateway.keys.job_model("*"))]
        assert len(records) == 2, records
