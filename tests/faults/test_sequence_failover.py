"""A sequence model's worker killed (SIGKILL) in the middle of its sequences: every
sequence goes on, on the worker that replaces it, with exactly the results it would have
had (each request changes the state once: checkpoints go with the answers)."""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest

from scheduler.redis_server import RedisServer
from sluice.sequences import SequenceRef
from tests.integration.conftest import load_examples_builder
from tests.support import procs
from tests.support.stack import Stack

SEQUENCES = 12
STEPS = 40


def _slot_worker(stack: Stack, slot: int) -> int | None:
    assert stack.process is not None
    for pid in procs.worker_pids(stack.process.pid, "accumulator"):
        argv = procs.cmdline(pid)
        if "--slot" in argv and argv[argv.index("--slot") + 1] == str(slot):
            return pid
    return None


@pytest.mark.timeout(180)
def test_sequences_survive_the_death_of_their_worker(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    load_examples_builder().build_all(tmp_path, models=("accumulator",))
    stack = Stack(tmp_path, redis_server.url)
    stack.start()
    try:
        victim = _slot_worker(stack, 0)
        assert victim is not None
        on_victim = [
            n for n in range(1, SEQUENCES + 1) if SequenceRef(n, False, False).slot(2) == 0
        ]
        assert on_victim, "some sequences live on the killed worker's slot"
        rng = random.Random(11)
        plans = {n + 1: [rng.randint(1, 9) for _ in range(STEPS)] for n in range(SEQUENCES)}
        halfway = threading.Barrier(SEQUENCES + 1, timeout=60)

        def run(sequence_id: int) -> list[float]:
            values = plans[sequence_id]
            got: list[float] = []
            with httpx.Client(base_url=stack.url, timeout=60) as http:
                for index, value in enumerate(values):
                    if index == STEPS // 2:
                        halfway.wait()
                    body = {
                        "inputs": [
                            {"name": "INPUT", "shape": [1, 1], "datatype": "FP32", "data": [value]}
                        ],
                        "parameters": {
                            "sequence_id": sequence_id,
                            "sequence_start": index == 0,
                            "sequence_end": index == STEPS - 1,
                        },
                    }
                    response = http.post("/v2/models/accumulator/infer", json=body)
                    assert response.status_code == 200, response.text
                    got.append(response.json()["outputs"][0]["data"][0])
                    time.sleep(0.002)
            return got

        with ThreadPoolExecutor(SEQUENCES) as pool:
            futures = {n: pool.submit(run, n) for n in plans}
            halfway.wait()  # every sequence has state on its worker
            time.sleep(0.05)  # requests in flight: some held by the victim as it dies
            os.kill(victim, signal.SIGKILL)
            results = {n: future.result() for n, future in futures.items()}

        for sequence_id, values in plans.items():
            assert results[sequence_id] == list(np.cumsum(values, dtype=np.float64)), sequence_id
        replacement = _slot_worker(stack, 0)
        assert replacement is not None and replacement != victim
    finally:
        stack.stop()
