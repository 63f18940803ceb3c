"""A sequence model's worker killed (SIGKILL) in the middle of its sequences: every
sequence goes on, on the worker that replaces it, with exactly the results it would have
had (each request changes the state once: checkpoints go with the answers)."""

from __future__ import annotations

import contextlib
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
from redis import Redis

from sluice.core.keys import Keys
from sluice.core.sequences import SequenceRef
from sluice.scheduler.executor.redis_server import RedisServer
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


def _owners(redis: Redis, namespace: str) -> list[str | None]:
    keys = Keys(namespace)
    found = [redis.get(keys.sequence_owner("accumulator", 1, slot)) for slot in (0, 1)]
    return [value.decode().split(" ", 1)[0] if value else None for value in found]


@pytest.mark.timeout(180)
def test_two_hosts_serve_a_sequence_model_and_one_dies(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """Two ``sluice up`` (hosts a and b) on one Redis each start a worker per slot: one per
    slot holds it, the other stands by. Host a dies whole (SIGKILL, every process); host
    b's standby workers take its slots after the lease's lifetime, and every sequence goes
    on with exactly its running sum."""
    load_examples_builder().build_all(tmp_path, models=("accumulator",))
    host_a = Stack(tmp_path, redis_server.url, env={"SLUICE_HOST_ID": "host-a"})
    host_a.start()
    host_b = Stack(
        tmp_path, redis_server.url, env={"SLUICE_HOST_ID": "host-b"}, namespace=host_a.namespace
    )
    redis = Redis.from_url(redis_server.url)
    try:
        host_b.start()
        owners = _owners(redis, host_a.namespace)
        assert None not in owners and "host-a" in owners, owners  # a started first
        rng = random.Random(5)
        plans = {n + 1: [rng.randint(1, 9) for _ in range(STEPS)] for n in range(SEQUENCES)}
        halfway = threading.Barrier(SEQUENCES + 1, timeout=60)

        def run(sequence_id: int) -> list[float]:
            got: list[float] = []
            with httpx.Client(base_url=host_b.url, timeout=60) as http:
                for index, value in enumerate(plans[sequence_id]):
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
            return got

        with ThreadPoolExecutor(SEQUENCES) as pool:
            futures = {n: pool.submit(run, n) for n in plans}
            halfway.wait()
            time.sleep(0.05)
            assert host_a.process is not None
            # Stopped first: a supervisor that saw a child die could start it again before
            # its own SIGKILL, and that new child would outlive "every process" of host a.
            os.kill(host_a.process.pid, signal.SIGSTOP)
            victims = [*procs.children(host_a.process.pid), host_a.process.pid]
            for pid in victims:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            results = {n: future.result() for n, future in futures.items()}

        for sequence_id, values in plans.items():
            assert results[sequence_id] == list(np.cumsum(values, dtype=np.float64)), sequence_id
        assert _owners(redis, host_a.namespace) == ["host-b", "host-b"]
    finally:
        redis.close()
        host_b.stop()
        host_a.stop()
