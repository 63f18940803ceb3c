"""A request that kills every worker it reaches ends in the dead-letter stream with an error
answer, after max_deliveries deliveries, and the model keeps serving everyone else."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import httpx
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families
from redis import Redis

from sluice.core.keys import Keys
from tests.faults.conftest import FAST_FAILURE_DETECTION, Report
from tests.support.stack import Stack

POISON_MODEL = """
import os
import signal


class Model:
    def execute(self, inputs):
        values = inputs["IN"]
        if (values < 0).any():
            os.kill(os.getpid(), signal.SIGKILL)
        return {"OUT": values * 2}
"""

CONFIG = """
name: "poison"
backend: "python"
max_batch_size: 8
input [ { name: "IN" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 1 ] } ]
instance_group [ { count: 2 kind: KIND_CPU } ]
"""


def _request(value: float) -> bytes:
    return orjson.dumps(
        {"inputs": [{"name": "IN", "shape": [1, 1], "datatype": "FP32", "data": [value]}]}
    )


@pytest.mark.timeout(180)
def test_poison_request_is_dead_lettered_and_others_are_served(
    tmp_path: Path, start_stack: Callable[..., Stack], report: Report
) -> None:
    (tmp_path / "poison" / "1").mkdir(parents=True)
    (tmp_path / "poison" / "1" / "model.py").write_text(POISON_MODEL)
    (tmp_path / "poison" / "config.pbtxt").write_text(CONFIG)
    stack = start_stack(tmp_path, env={**FAST_FAILURE_DETECTION, "SLUICE_MAX_DELIVERIES": "3"})

    with httpx.Client(base_url=stack.url, timeout=90) as http:
        assert http.post("/v2/models/poison/infer", content=_request(1.0)).status_code == 200
        started = time.monotonic()
        poisoned = http.post("/v2/models/poison/infer", content=_request(-1.0))
        elapsed = time.monotonic() - started
        assert poisoned.status_code == 500, poisoned.text
        assert "dead-letter" in poisoned.json()["error"]
        assert "delivered 3 times" in poisoned.json()["error"]

        # The supervisor restarts the killed workers; the model serves again.
        deadline = time.monotonic() + 30
        while True:
            healthy = http.post("/v2/models/poison/infer", content=_request(2.0))
            if healthy.status_code == 200 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert healthy.status_code == 200, healthy.text
        assert healthy.json()["outputs"][0]["data"] == [4.0]
        # The operators' view: one entry dead-lettered, each take-over counted.
        samples = {
            (s.name, s.labels.get("model")): s.value
            for family in text_string_to_metric_families(http.get("/metrics").text)
            for s in family.samples
        }
        assert samples[("sluice_dead_letter_entries_total", "poison")] == 1
        assert samples[("sluice_reclaimed_entries_total", "poison")] >= 2

    redis = Redis.from_url(stack.redis_url)
    try:
        dead = redis.xrange(Keys(stack.namespace).dead_letters("poison", 1))
    finally:
        redis.close()
    assert len(dead) == 1
    assert b"delivered 3 times" in dead[0][1][b"reason"]
    report({"poison_answer_s": round(elapsed, 2), "dead_letters": len(dead)})
