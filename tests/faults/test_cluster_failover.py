"""A Redis Cluster primary dies under load (issue 17): its replica takes over, and Sluice
goes on by itself.

The primary killed is the one holding the model's request stream. Every request gets an
answer: the right one, or a quick retryable 503/504 while the shard fails over (requests
whose entry the dead primary had not yet passed to its replica are failed at once rather
than left to time out). Once the cluster is healthy again, requests succeed without any
Sluice process being restarted.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import pytest

from sluice.core.keys import Keys
from tests.faults.conftest import FAST_FAILURE_DETECTION, MODEL, TWO_WORKERS, Report
from tests.support import procs
from tests.support.load import Answer, Load, check_response, slow_request
from tests.support.redis_cluster import LocalRedisCluster
from tests.support.slow_model import write_slow
from tests.support.stack import Stack

pytestmark = pytest.mark.cluster

TIMEOUT_US = 5_000_000
CLIENT_TIMEOUT_S = TIMEOUT_US / 1e6 + 5.0
RECOVERY_S = 20.0


@pytest.fixture
def own_cluster() -> Iterator[LocalRedisCluster]:
    cluster = LocalRedisCluster()
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


def _infer(url: str, index: int) -> Answer:
    started = time.monotonic()
    body = orjson.dumps(slow_request(index, 0, timeout_us=TIMEOUT_US))
    with httpx.Client(base_url=url, timeout=CLIENT_TIMEOUT_S) as http:
        try:
            response = http.post(f"/v2/models/{MODEL}/infer", content=body)
        except httpx.HTTPError as exc:
            return Answer(index, None, error=repr(exc), well_formed=False)
    return check_response(index, response, started)


@pytest.mark.timeout(150)
def test_primary_failover_under_load(
    tmp_path: Path, own_cluster: LocalRedisCluster, report: Report
) -> None:
    write_slow(tmp_path, MODEL, extra=TWO_WORKERS)
    # One gateway process: "recovered" starts with the first correct answer, and a second
    # process would notice the failover, and fail what it holds, up to a refresh later.
    stack = Stack(
        tmp_path, own_cluster.url, env=FAST_FAILURE_DETECTION, args=["--gateway-processes", "1"]
    )
    stack.start()
    try:
        assert stack.process is not None
        children_before = procs.children(stack.process.pid)
        load = Load(
            stack.url,
            MODEL,
            concurrency=4,
            total=10**6,
            build=lambda i: slow_request(i, 20, timeout_us=TIMEOUT_US),
            client_timeout_s=CLIENT_TIMEOUT_S,
        ).start()
        time.sleep(1.5)
        stream = Keys(stack.namespace).request_stream(MODEL, 1)
        victim = own_cluster.primary_of(stream)
        killed_at = time.monotonic()
        own_cluster.kill(victim)
        promoted = own_cluster.wait_promoted(stream)
        healthy_at = time.monotonic()
        assert promoted.port != victim.port
        recovered_at: float | None = None
        probes: list[Answer] = []
        # Recovered once five probes in a row are answered: each gateway process notices
        # the new primary at its own refresh, and a busy machine spreads those out.
        in_a_row = 0
        while time.monotonic() < healthy_at + RECOVERY_S:
            probes.append(_infer(stack.url, 5_000_000 + len(probes)))
            in_a_row = in_a_row + 1 if probes[-1].correct else 0
            if in_a_row == 5:
                recovered_at = time.monotonic()
                break
            time.sleep(0.2)
        time.sleep(3.0)  # the load runs on the new primary for a while
        after = [_infer(stack.url, 6_000_000 + n) for n in range(10)]
        load.stop()
        load.join(CLIENT_TIMEOUT_S + 5)
        children_after = procs.children(stack.process.pid)
    finally:
        stack.stop()

    def phase(answer: Answer) -> str:
        if answer.started_s + answer.latency_s < killed_at:
            return "before"
        if recovered_at is None or answer.started_s < recovered_at:
            return "failing_over"
        return "recovered"

    statuses: dict[str, Counter[str]] = {}
    for answer in load.answers + probes:
        statuses.setdefault(phase(answer), Counter())[str(answer.status)] += 1
    figures = load.figures()
    figures.update(
        statuses_by_phase={k: dict(v) for k, v in statuses.items()},
        failover_s=round(healthy_at - killed_at, 2),
        recovered_after_failover_s=None
        if recovered_at is None
        else round(recovered_at - healthy_at, 2),
        errors=sorted({a.error or "" for a in load.answers if a.status != 200})[:4],
        after_recovery=dict(Counter(str(a.status) for a in after)),
        sluice_processes_kept=children_before == children_after,
    )
    report(figures)

    everything = load.answers + probes + after
    assert all(a.status is not None for a in everything), "a client got no HTTP answer"
    assert not figures["wrong_answers"] and not figures["malformed_errors"], figures
    assert max(a.latency_s for a in everything) < CLIENT_TIMEOUT_S, figures
    assert set(statuses.get("before", {})) <= {"200"}, figures
    assert set(statuses.get("failing_over", {})) <= {"200", "503", "504"}, figures
    assert recovered_at is not None, f"no correct answer {RECOVERY_S} s after the failover"
    assert all(a.correct for a in after), figures
    assert set(statuses.get("recovered", {})) <= {"200"}, figures
    assert figures["lost"] == 0, figures
    assert children_before == children_after, "a Sluice process was restarted:\n" + "".join(
        [line for line in stack.stderr_lines if "reading requests failed" not in line][-60:]
    )
