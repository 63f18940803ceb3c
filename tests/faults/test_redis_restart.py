"""Redis goes away for two seconds and comes back on the same port (issue 4).

While it is away, clients get a quick 503 (or 504) with a JSON error, never a hang
past their timeout, and ``/v2/health/ready`` says not ready. Once it is back, Sluice
serves again on its own, without being restarted: the catalog, the consumer groups,
the reply stream and the heartbeats all come back.
"""

from __future__ import annotations

import re
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import pytest

from scheduler.redis_server import RedisServer, free_port
from tests.faults.conftest import FAST_FAILURE_DETECTION, MODEL, Report
from tests.support import procs
from tests.support.load import Answer, Load, check_response, slow_request
from tests.support.slow_model import write_slow
from tests.support.stack import Stack

TIMEOUT_US = 3_000_000
MARGIN_S = 5.0
OUTAGE_S = 2.0
RECOVERY_S = 15.0


@pytest.fixture
def own_redis() -> Iterator[list[RedisServer]]:
    """A redis-server of this test's own; the test appends the restarted one."""
    servers = [RedisServer(port=free_port())]
    servers[0].start()
    yield servers
    for server in servers:
        server.stop()


def _probe(http: httpx.Client, index: int) -> Answer:
    started = time.monotonic()
    response = http.post(
        f"/v2/models/{MODEL}/infer",
        content=orjson.dumps(slow_request(index, 0, timeout_us=TIMEOUT_US)),
    )
    return check_response(index, response, started)


@pytest.mark.timeout(120)
def test_redis_restart_is_survived(
    tmp_path: Path, own_redis: list[RedisServer], report: Report
) -> None:
    write_slow(tmp_path, MODEL, extra="dynamic_batching { max_queue_delay_microseconds: 1000 }")
    server = own_redis[0]
    stack = Stack(tmp_path, server.url, env=FAST_FAILURE_DETECTION)
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
            client_timeout_s=TIMEOUT_US / 1e6 + MARGIN_S,
        ).start()
        with httpx.Client(base_url=stack.url, timeout=TIMEOUT_US / 1e6 + MARGIN_S) as http:
            time.sleep(1.0)
            killed_at = time.monotonic()
            assert server.process is not None
            server.process.kill()
            server.process.wait()

            ready_statuses: list[int] = []
            outage_probe: Answer | None = None
            not_ready_after: float | None = None
            while time.monotonic() < killed_at + OUTAGE_S:
                status = http.get("/v2/health/ready").status_code
                ready_statuses.append(status)
                if status != 200 and not_ready_after is None:
                    not_ready_after = time.monotonic() - killed_at
                    outage_probe = _probe(http, 2_000_000)
                time.sleep(0.1)

            restarted = RedisServer(port=server.port)
            own_redis.append(restarted)
            restarted.start()
            back_at = time.monotonic()

            recovered_at: float | None = None
            probes: list[Answer] = []
            while time.monotonic() < back_at + RECOVERY_S:
                probes.append(_probe(http, 3_000_000 + len(probes)))
                ready = http.get("/v2/health/ready").status_code == 200
                if probes[-1].correct and ready:
                    recovered_at = time.monotonic()
                    break
                time.sleep(0.2)
            if recovered_at is not None:
                time.sleep(1.0)
            load.stop()
            load.join(TIMEOUT_US / 1e6 + MARGIN_S + 5)
            finished_at = time.monotonic()
            after_recovery = [_probe(http, 4_000_000 + n) for n in range(5)]
        children_after = procs.children(stack.process.pid)
    finally:
        stack.stop()

    def phase(answer: Answer) -> str:
        ended = answer.started_s + answer.latency_s
        if ended < killed_at:
            return "before"
        if answer.started_s < killed_at:
            return "in_flight_at_kill"
        if answer.started_s < back_at:
            return "outage"
        if recovered_at is None or answer.started_s < recovered_at:
            return "recovering"
        return "recovered"

    by_phase: dict[str, Counter[str]] = {}
    messages: dict[str, Counter[str]] = {}
    for answer in load.answers + probes:
        by_phase.setdefault(phase(answer), Counter())[str(answer.status)] += 1
        if answer.status != 200:
            text = re.sub(r"\d+", "N", f"{answer.status} {answer.error}")
            messages.setdefault(phase(answer), Counter())[text] += 1
    figures = load.figures()
    figures.update(
        statuses_by_phase={k: dict(v) for k, v in by_phase.items()},
        errors_by_phase={k: dict(v.most_common(4)) for k, v in messages.items()},
        ready_statuses_during_outage=dict(Counter(ready_statuses)),
        not_ready_after_s=None if not_ready_after is None else round(not_ready_after, 2),
        outage_probe=None
        if outage_probe is None
        else {"status": outage_probe.status, "error": outage_probe.error},
        recovered_after_s=None if recovered_at is None else round(recovered_at - back_at, 2),
        last_probe_before_recovery=None
        if not probes
        else {"status": probes[-1].status, "error": probes[-1].error},
        after_recovery_statuses=[a.status for a in after_recovery],
        load_stopped_after_s=round(finished_at - killed_at, 2),
        children_kept=children_before == children_after,
    )
    report(figures)

    everything = load.answers + probes + after_recovery
    assert all(a.status is not None for a in everything), "a client got no HTTP answer"
    assert figures["malformed_errors"] == 0
    assert figures["wrong_answers"] == 0
    slowest = max(a.latency_s for a in everything)
    assert slowest < TIMEOUT_US / 1e6 + MARGIN_S, f"a call took {slowest:.1f} s"
    assert set(by_phase.get("before", {})) <= {"200"}
    assert set(by_phase.get("in_flight_at_kill", {})) <= {"200", "503", "504"}
    assert set(by_phase["outage"]) <= {"503", "504"}, by_phase["outage"]
    assert not_ready_after is not None and not_ready_after < OUTAGE_S
    assert outage_probe is not None and outage_probe.status == 503 and outage_probe.well_formed
    assert outage_probe.latency_s < 1.0
    assert recovered_at is not None, (
        f"no successful request within {RECOVERY_S} s after Redis came back; last answer: "
        f"{figures['last_probe_before_recovery']}"
    )
    assert all(a.correct for a in after_recovery)
    assert set(by_phase.get("recovered", {})) <= {"200"}, by_phase["recovered"]
    assert children_before == children_after, "Sluice restarted processes to recover"
