"""A batch worker's runner on a real redis-server and a real store, over a stand-in model
``m`` (X → Y, FP32 [-1], batch 8), and its jobs planned as the gateway lists them: what
the runner's tests share."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import pytest

from sluice.batch.runner import Runner
from sluice.core.batch_jobs import batches as b
from sluice.core.batch_jobs import turns
from sluice.core.clock import CLOCK
from sluice.core.config import ModelConfig, parse_config_text
from sluice.core.keys import Keys
from sluice.core.settings import BatchSettings
from sluice.scheduler.executor.redis_server import RedisServer


def model_config(dims: str = "-1", max_batch_size: int = 8) -> ModelConfig:
    """The stand-in model ``m``: X → Y, FP32 of ``dims``."""
    return parse_config_text(
        f"""
        name: "m"
        backend: "python"
        max_batch_size: {max_batch_size}
        input [ {{ name: "X" data_type: TYPE_FP32 dims: [ {dims} ] }} ]
        output [ {{ name: "Y" data_type: TYPE_FP32 dims: [ {dims} ] }} ]
        """,
        model_name="m",
    )


CONFIG = model_config()
TENANT = "team-a"


def make_runner(
    redis_server: RedisServer,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    config: ModelConfig = CONFIG,
    on_shard: Callable[[str, int], None] = lambda batch_id, index: None,
    namespace: str = "",
    on_plan: Callable[[str], None] | None = None,
    **settings: Any,
) -> Runner:
    """A runner in a namespace of its own (or ``namespace``: a gateway's under test) whose
    jobs all run ``config`` (close it after); ``on_shard`` sees each shard it queues,
    ``on_plan`` each plan task (of a job whose turn came)."""
    made = Runner(
        BatchSettings(
            redis_url=redis_server.url,
            namespace=namespace or f"t{uuid.uuid4().hex[:8]}",
            batch_store=str(tmp_path / "store"),
            batch_root=str(tmp_path),
            **settings,
        ),
        on_shard,
        on_plan,
    )
    monkeypatch.setattr(made, "_model", lambda record: (config, 1))
    return made


def written(
    runner: Runner, source: Path, options: b.BatchOptions, tenant: str = TENANT, status: str = ""
) -> str:
    """A new job record of ``tenant`` over ``source`` (listed among its jobs, as the gateway
    lists it), in ``status`` (planning when not given); its id."""
    batch_id = uuid.uuid4().hex
    keys = Keys(runner.settings.namespace)
    runner.redis.zadd(keys.batches(tenant), {batch_id: 1.0})
    runner.redis.hset(
        keys.batch(batch_id),
        mapping={
            b.F_STATUS: status or b.PLANNING,
            b.F_MODEL: "m",
            b.F_INPUT: str(source),
            b.F_OUTPUT: "",
            b.F_OPTIONS: orjson.dumps(options.to_json()),
            b.F_OWNER: tenant,
        },
    )
    return batch_id


def planned(runner: Runner, source: Path, options: b.BatchOptions) -> str:
    """A new job of :data:`TENANT` over ``source``, planned; its id."""
    batch_id = written(runner, source, options)
    runner.plan(batch_id, resume=False)
    return batch_id


def resumed(runner: Runner, batch_id: str, tenant: str = TENANT) -> int:
    """``POST /v2/batches/{id}/resume`` as the gateway makes it, without its plan task: a
    job that ended takes a free turn of its tenant's and starts; its place in the tenant's
    line (0: it started)."""
    key = runner.keys.batch(batch_id)
    runner.redis.eval(b.RESUME, 1, key, f"{CLOCK.now():.6f}", b.RESUME_QUEUED_S)
    place = runner.turns.admit(tenant, batch_id)
    if not place:
        runner.redis.eval(turns.START, 1, key, f"{CLOCK.now():.6f}", b.RESUME_QUEUED_S)
    return place
