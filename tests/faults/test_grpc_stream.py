"""Faults under gRPC streaming (issue 13): a worker killed (SIGKILL) while a
``ModelStreamInfer`` stream has requests under way loses no answer and answers none twice;
a client that cancels its stream mid-way leaves nothing behind in the gateway."""

from __future__ import annotations

import queue
import re
import signal
import time
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from redis import Redis

from tests.faults.conftest import MODEL, Report, signal_a_busy_worker
from tests.support import procs
from tests.support.load import marker
from tests.support.stack import Stack

REQUESTS = 600


def slow_inputs(index: int, iters: int) -> list[grpcclient.InferInput]:
    values = grpcclient.InferInput("IN", [1, 4], "FP32")
    values.set_data_from_numpy(np.array([marker(index)], dtype=np.float32))
    rounds = grpcclient.InferInput("ITERS", [1, 1], "INT64")
    rounds.set_data_from_numpy(np.array([[iters]], dtype=np.int64))
    return [values, rounds]


@pytest.mark.timeout(180)
def test_killed_worker_during_a_stream_loses_and_repeats_nothing(
    two_workers: tuple[Stack, Redis], report: Report
) -> None:
    stack, redis = two_workers
    answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
    with grpcclient.InferenceServerClient(stack.grpc_address) as client:
        client.start_stream(callback=lambda result, error: answers.put((result, error)))
        for index in range(REQUESTS):
            client.async_stream_infer(MODEL, slow_inputs(index, 20), request_id=f"req-{index}")
        victim, held = signal_a_busy_worker(redis, stack, signal.SIGKILL)
        assert procs.wait_until(lambda: not procs.alive(victim), 5)

        seen: dict[str, int] = {}
        errors: list[str] = []
        wrong: list[str] = []
        for _ in range(REQUESTS):
            result, error = answers.get(timeout=120)
            if error is not None:
                errors.append(str(error))
                continue
            request_id = result.get_response().id
            seen[request_id] = seen.get(request_id, 0) + 1
            index = int(request_id.removeprefix("req-"))
            if result.as_numpy("OUT").tolist() != [marker(index)]:
                wrong.append(request_id)
        time.sleep(1.0)  # a duplicate would arrive after the last expected answer
        extra = answers.qsize()
        client.stop_stream()

    report(
        {
            "requests": REQUESTS,
            "held_by_victim": len(held),
            "answered": len(seen),
            "errors": len(errors),
        }
    )
    assert held, "the killed worker held no request"
    assert errors == []
    assert wrong == []
    assert sorted(seen) == sorted(f"req-{index}" for index in range(REQUESTS))
    assert set(seen.values()) == {1} and extra == 0, "an answer came twice"


def gateway_in_flight(stack: Stack) -> float:
    text = httpx.get(f"{stack.url}/metrics", timeout=10).text
    match = re.search(r"^sluice_gateway_in_flight (\S+)$", text, re.MULTILINE)
    assert match is not None, "no sluice_gateway_in_flight in /metrics"
    return float(match.group(1))


@pytest.mark.timeout(120)
def test_a_cancelled_stream_leaves_nothing_behind(
    two_workers: tuple[Stack, Redis], report: Report
) -> None:
    stack, _ = two_workers
    with grpcclient.InferenceServerClient(stack.grpc_address) as client:
        client.start_stream(callback=lambda result, error: None)
        for index in range(40):  # about a second of compute per batch
            client.async_stream_infer(MODEL, slow_inputs(index, 50_000), request_id=f"c-{index}")
        assert procs.wait_until(lambda: gateway_in_flight(stack) > 0, 10)
        held_before = gateway_in_flight(stack)
        client.stop_stream(cancel_requests=True)
    cancelled_at = time.monotonic()
    released = procs.wait_until(lambda: gateway_in_flight(stack) == 0, 10)
    report({"in_flight_before": held_before, "released_s": time.monotonic() - cancelled_at})
    assert released, f"the gateway still holds {gateway_in_flight(stack)} requests"
    # And it serves as before.
    with grpcclient.InferenceServerClient(stack.grpc_address) as client:
        result = client.infer(MODEL, slow_inputs(1, 1))
        assert result.as_numpy("OUT").tolist() == [marker(1)]
