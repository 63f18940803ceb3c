"""Redis goes away for two seconds or more and comes back on the same port (issue 4).

While it is away, clients get a quick 503 (or 504) with a JSON error, never a hang
past their timeout, and ``/v2/health/ready`` says not ready. Once it is back, Sluice
serves again on its own, without being restarted: the catalog, the consumer groups,
the reply stream, the heartbeats and every pooled Redis connection come back.
"""

from __future__ import annotations

import re
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import httpx
import orjson
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from sluice.scheduler.executor.redis_server import RedisServer, free_port
from tests.faults.conftest import FAST_FAILURE_DETECTION, MODEL, Report
from tests.support import procs
from tests.support.load import Answer, Load, check_response, slow_request
from tests.support.slow_model import write_slow
from tests.support.stack import Stack

TIMEOUT_US = 3_000_000
CLIENT_TIMEOUT_S = TIMEOUT_US / 1e6 + 5.0
OUTAGE_S = 2.0
NOTICED_WITHIN_S = 30.0
"""Redis stays away OUTAGE_S, and longer until the gateway says it is not ready (its next
refresh notices, half a second apart under load; a busy machine may stretch that past the
outage): what the test checks during the outage is checked while it lasts."""
RECOVERY_S = 15.0
BURST = 8
IN_FLIGHT_MARGIN_S = 0.05
"""Requests sent this soon after Redis was seen dead count as in flight at the kill."""


@pytest.fixture
def own_redis() -> Iterator[list[RedisServer]]:
    """A redis-server of this test's own; the test appends the restarted one."""
    servers = [RedisServer(port=free_port())]
    servers[0].start()
    yield servers
    for server in servers:
        server.stop()


def _infer(url: str, index: int) -> Answer:
    started = time.monotonic()
    body = orjson.dumps(slow_request(index, 0, timeout_us=TIMEOUT_US))
    with httpx.Client(base_url=url, timeout=CLIENT_TIMEOUT_S) as http:
        try:
            response = http.post(f"/v2/models/{MODEL}/infer", content=body)
        except httpx.HTTPError as exc:
            return Answer(index, None, error=repr(exc), well_formed=False)
    return check_response(index, response, started)


def _get(url: str, path: str) -> tuple[int, str | None]:
    """Status and JSON error of a GET (error None when the body is not a JSON error)."""
    with httpx.Client(base_url=url, timeout=CLIENT_TIMEOUT_S) as http:
        response = http.get(path)
    try:
        error = orjson.loads(response.content).get("error")
    except (orjson.JSONDecodeError, AttributeError):
        error = None
    return response.status_code, error if isinstance(error, str) else None


def _grpc_health(address: str) -> str:
    """The gRPC health service's status of the whole server (SERVING, NOT_SERVING)."""
    with grpc.insecure_channel(address) as channel:
        answer = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=CLIENT_TIMEOUT_S
        )
    return health_pb2.HealthCheckResponse.ServingStatus.Name(answer.status)


def _burst(url: str, base: int) -> tuple[list[tuple[int, str | None]], list[Answer]]:
    """BURST concurrent stats reads and BURST concurrent inferences: these need as many
    Redis connections at once, so the gateway's pool hands out every connection it has."""
    stats_path = f"/v2/models/{MODEL}/stats"
    with ThreadPoolExecutor(2 * BURST) as pool:
        stats = [pool.submit(_get, url, stats_path) for _ in range(BURST)]
        infers = [pool.submit(_infer, url, base + n) for n in range(BURST)]
        return [f.result() for f in stats], [f.result() for f in infers]


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
            client_timeout_s=CLIENT_TIMEOUT_S,
        ).start()
        time.sleep(0.5)
        burst_before = _burst(stack.url, 1_000_000)
        time.sleep(0.5)

        killed_at = time.monotonic()
        assert server.process is not None
        server.process.kill()
        server.process.wait()
        dead_at = time.monotonic()
        ready_statuses: list[int] = []
        not_ready_after: float | None = None
        outage_infer: Answer | None = None
        outage_stats: tuple[int, str | None] | None = None
        outage_grpc_health = ""
        while time.monotonic() < killed_at + OUTAGE_S or (
            not_ready_after is None and time.monotonic() < killed_at + NOTICED_WITHIN_S
        ):
            status, _ = _get(stack.url, "/v2/health/ready")
            ready_statuses.append(status)
            if status != 200 and not_ready_after is None:
                not_ready_after = time.monotonic() - killed_at
                outage_infer = _infer(stack.url, 2_000_000)
                outage_stats = _get(stack.url, f"/v2/models/{MODEL}/stats")
                outage_grpc_health = _grpc_health(stack.grpc_address)
            time.sleep(0.1)

        restarting_at = time.monotonic()
        restarted = RedisServer(port=server.port)
        own_redis.append(restarted)
        restarted.start()
        back_at = time.monotonic()
        recovered_at: float | None = None
        probes: list[Answer] = []
        while time.monotonic() < back_at + RECOVERY_S:
            probes.append(_infer(stack.url, 3_000_000 + len(probes)))
            if probes[-1].correct and _get(stack.url, "/v2/health/ready")[0] == 200:
                recovered_at = time.monotonic()
                break
            time.sleep(0.2)
        burst_after = _burst(stack.url, 4_000_000) if recovered_at else ([], [])
        recovered_grpc_health = _grpc_health(stack.grpc_address) if recovered_at else ""
        time.sleep(1.0)
        load.stop()
        load.join(CLIENT_TIMEOUT_S + 5)
        children_after = procs.children(stack.process.pid)
    finally:
        stack.stop()

    def phase(answer: Answer) -> str:
        if answer.started_s + answer.latency_s < killed_at:
            return "before"
        if answer.started_s < dead_at + IN_FLIGHT_MARGIN_S:
            return "in_flight_at_kill"  # (sent as it died: its entry may have gone in)
        if answer.started_s < restarting_at:
            return "outage"
        if recovered_at is None or answer.started_s < recovered_at:
            return "recovering"
        return "recovered"

    statuses: dict[str, Counter[str]] = {}
    messages: dict[str, Counter[str]] = {}
    for answer in load.answers + probes:
        statuses.setdefault(phase(answer), Counter())[str(answer.status)] += 1
        if answer.status != 200:
            text = re.sub(r"\d+", "N", f"{answer.status} {answer.error}")
            messages.setdefault(phase(answer), Counter())[text] += 1

    def burst_figures(burst: tuple[list[tuple[int, str | None]], list[Answer]]) -> dict:
        stats, infers = burst
        return {
            "stats": dict(Counter(str(status) for status, _ in stats)),
            "infer": dict(Counter(str(a.status) for a in infers)),
            "errors": sorted({e for _, e in stats if e} | {a.error for a in infers if a.error}),
        }

    figures = load.figures()
    figures.update(
        statuses_by_phase={k: dict(v) for k, v in statuses.items()},
        errors_by_phase={k: dict(v.most_common(4)) for k, v in messages.items()},
        ready_statuses_during_outage=dict(Counter(map(str, ready_statuses))),
        not_ready_after_s=None if not_ready_after is None else round(not_ready_after, 2),
        outage_infer=None
        if outage_infer is None
        else {
            "status": outage_infer.status,
            "error": outage_infer.error,
            "s": round(outage_infer.latency_s, 3),
        },
        outage_stats=outage_stats,
        grpc_health_during_outage=outage_grpc_health,
        grpc_health_after_recovery=recovered_grpc_health,
        redis_restart_s=round(back_at - restarting_at, 2),
        recovered_after_s=None if recovered_at is None else round(recovered_at - back_at, 2),
        last_probe=None if not probes else {"status": probes[-1].status, "error": probes[-1].error},
        burst_before_outage=burst_figures(burst_before),
        burst_after_recovery=burst_figures(burst_after),
        sluice_processes_kept=children_before == children_after,
    )
    report(figures)

    everything = load.answers + probes + burst_after[1]
    slowest = max(a.latency_s for a in everything)
    problems = []
    if any(a.status is None for a in everything):
        problems.append("a client got no HTTP answer")
    if figures["malformed_errors"] or figures["wrong_answers"]:
        problems.append("an error without a JSON 'error', or a wrong answer")
    if slowest >= CLIENT_TIMEOUT_S:
        problems.append(f"a call took {slowest:.1f} s, past its timeout + 5 s")
    if not set(statuses.get("before", {})) <= {"200"}:
        problems.append(f"errors before the outage: {statuses['before']}")
    if not set(statuses.get("in_flight_at_kill", {})) <= {"200", "503", "504"}:
        problems.append(f"requests in flight at the kill: {statuses['in_flight_at_kill']}")
    if not set(statuses.get("outage", {})) <= {"503", "504"}:
        problems.append(f"during the outage: {messages.get('outage')}")
    if not_ready_after is None:
        problems.append("/v2/health/ready stayed 200 during the outage")
    if outage_infer is None or outage_infer.status != 503 or outage_infer.latency_s > 1.0:
        problems.append(f"inference during the outage: {figures['outage_infer']}")
    if outage_stats is None or outage_stats[0] != 503 or outage_stats[1] is None:
        problems.append(f"GET stats during the outage is not a JSON 503: {outage_stats}")
    if outage_grpc_health != "NOT_SERVING":  # (set by the same refresh as HTTP's)
        problems.append(f"gRPC health during the outage: {outage_grpc_health}")
    if recovered_at is not None and recovered_grpc_health != "SERVING":
        problems.append(f"gRPC health after recovery: {recovered_grpc_health}")
    if recovered_at is None:
        problems.append(
            f"not serving {RECOVERY_S} s after Redis came back: {figures['last_probe']}"
        )
    if not set(statuses.get("recovered", {})) <= {"200"}:
        problems.append(f"errors after recovery: {messages.get('recovered')}")
    if figures["burst_after_recovery"]["stats"] != {"200": BURST} or not all(
        a.correct for a in burst_after[1]
    ):
        problems.append(f"burst after recovery: {figures['burst_after_recovery']}")
    if children_before != children_after:
        problems.append("Sluice restarted processes to recover")
    if problems:  # what the stack logged says why
        print("".join(stack.stderr_lines[-120:]))
    assert not problems, problems
