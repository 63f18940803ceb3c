"""Per-tenant limits over a real stack (SLUICE_TENANT_LIMITS_FILE): a tenant over its rate
gets 429 with Retry-After and the limit's name while another tenant of the same model is
answered; the file's changes apply without a restart; a bad file keeps the limits in force;
gRPC callers see RESOURCE_EXHAUSTED; /metrics counts per tenant."""

from __future__ import annotations

import os
import re
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import numpy as np
import orjson
import pytest
import redis
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from sluice.core.keys import Keys
from sluice.scheduler.executor.redis_server import RedisServer
from tests.support.onnx_models import write_identity
from tests.support.stack import Stack

MODEL = "shared"
KEY_A, KEY_B = "key-of-team-a", "key-of-team-b"
BODY = orjson.dumps(
    {"inputs": [{"name": "IN_FP32", "shape": [1, 3], "datatype": "FP32", "data": [1, 2, 3]}]}
)
STRICT = """
[tenants.team-a]
weight = 2
rate = 0.001   # one request every 1000 s: the burst is all team-a gets
burst = 2
"""
RELAXED = """
[tenants.team-a]
rate = 1000
burst = 1000
"""
WAIT_S = 30.0
"""How long a reload may take to show (it comes within a second or two)."""


def replace(path: Path, text: str) -> None:
    """Write the file as an operator's tool would: a whole new file moved in place."""
    staged = path.with_suffix(".new")
    staged.write_text(text)
    os.replace(staged, path)


@pytest.fixture(scope="module")
def limits_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tenant-limits") / "limits.toml"
    path.write_text(STRICT)
    return path


def _tenants_stack(
    tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer, env: dict[str, str]
) -> Iterator[Stack]:
    """A stack of the identity model with team-a's and team-b's keys, and ``env``."""
    root = tmp_path_factory.mktemp("tenants")
    write_identity(root / "repository", MODEL, ["FP32"])
    keys = {"SLUICE_API_KEYS": f"team-a:{KEY_A},team-b:{KEY_B}"}
    stack = Stack(root / "repository", redis_server.url, env=keys | env)
    stack.start()
    yield stack
    stack.stop()


@pytest.fixture(scope="module")
def stack(
    tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer, limits_file: Path
) -> Iterator[Stack]:
    yield from _tenants_stack(
        tmp_path_factory,
        redis_server,
        {
            "SLUICE_TENANT_LIMITS_FILE": str(limits_file),
            "SLUICE_GATEWAY_PROCESSES": "1",  # (the whole rate is this process's)
        },
    )


@pytest.fixture(scope="module")
def http(stack: Stack) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=stack.url, timeout=30) as client:
        yield client


def infer(http: httpx.Client, key: str) -> httpx.Response:
    return http.post(
        f"/v2/models/{MODEL}/infer",
        content=BODY,
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
    )


def metric(http: httpx.Client, name: str, **labels: str) -> float:
    text = http.get("/metrics", headers={"Authorization": f"Bearer {KEY_B}"}).text
    wanted = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    total = 0.0
    for line in text.splitlines():
        match = re.fullmatch(rf"{name}(?:\{{(.*)\}})? (\S+)", line)
        if match and ",".join(sorted((match.group(1) or "").split(","))) == wanted:
            total += float(match.group(2))
    return total


def eventually(check: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.2)
    raise AssertionError(f"not within {WAIT_S} s: {what}")


def spend_the_burst(http: httpx.Client) -> None:
    """team-a over its rate: its burst spent, by the tests before or now (a gateway process
    that was restarted meanwhile starts with a full bucket)."""
    assert any(infer(http, KEY_A).status_code == 429 for _ in range(3))


def test_a_tenant_over_its_rate_is_refused_and_the_other_is_not(http: httpx.Client) -> None:
    answers = [infer(http, KEY_A) for _ in range(4)]
    statuses = [a.status_code for a in answers]
    assert statuses[:2] == [200, 200], [a.text for a in answers]
    refused = answers[2]
    assert refused.status_code == 429, refused.text
    assert int(refused.headers["retry-after"]) >= 1
    assert refused.json()["error"] == (
        "tenant 'team-a' is over its rate limit (rate=0.001/s, burst=2); retry later"
    )
    job = http.post(
        f"/v2/models/{MODEL}/infer",
        content=BODY,
        headers={"Authorization": f"Bearer {KEY_A}", "Prefer": "respond-async"},
    )
    assert job.status_code == 429, job.text
    assert "over its rate limit" in job.json()["error"]
    for _ in range(10):
        response = infer(http, KEY_B)
        assert response.status_code == 200, response.text
    eventually(
        lambda: metric(http, "sluice_tenant_rejected_total", tenant="team-a", limit="rate") >= 3,
        "team-a's refusals on /metrics",
    )
    # (each gateway process hands its counts over at its next report)
    eventually(
        lambda: metric(http, "sluice_tenant_requests_total", tenant="team-b") >= 10,
        "team-b's requests on /metrics",
    )
    assert metric(http, "sluice_tenant_limit", tenant="team-a", limit="burst") == 2
    assert metric(http, "sluice_tenant_limit", tenant="team-a", limit="weight") == 2


def test_a_large_request_over_the_rate_is_refused_before_its_body_is_read(
    stack: Stack, http: httpx.Client
) -> None:
    """team-a is over its rate: a request announcing a megabyte is refused at once,
    although its body never comes, and the connection is closed after it."""
    spend_the_burst(http)
    host, port = stack.address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as connection:
        connection.sendall(
            f"POST /v2/models/{MODEL}/infer HTTP/1.1\r\nhost: x\r\n"
            f"authorization: Bearer {KEY_A}\r\ncontent-type: application/json\r\n"
            f"content-length: {1 << 20}\r\n\r\n".encode()
        )
        answer = b""
        while chunk := connection.recv(65536):  # (the server closes the connection)
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 429"), answer
    assert b"connection: close" in head.lower() and b"retry-after" in head.lower()
    assert b"over its rate limit" in body


def test_the_weights_are_written_for_the_workers(stack: Stack, redis_server: RedisServer) -> None:
    client = redis.Redis.from_url(redis_server.url, decode_responses=True)
    try:
        weights = client.hgetall(Keys(stack.namespace).tenant_weights)
    finally:
        client.close()
    assert weights == {"*": "1", "team-a": "2"}


def test_grpc_over_the_rate_is_resource_exhausted(stack: Stack, http: httpx.Client) -> None:
    spend_the_burst(http)
    client = grpcclient.InferenceServerClient(stack.grpc_address)
    data = grpcclient.InferInput("IN_FP32", [1, 3], "FP32")
    data.set_data_from_numpy(np.ones((1, 3), dtype=np.float32))
    with pytest.raises(InferenceServerException) as caught:
        client.infer(MODEL, [data], headers={"authorization": f"Bearer {KEY_A}"})
    assert caught.value.status() == "StatusCode.RESOURCE_EXHAUSTED"
    assert "tenant 'team-a' is over its rate limit" in str(caught.value.message())
    answer = client.infer(MODEL, [data], headers={"authorization": f"Bearer {KEY_B}"})
    assert answer.as_numpy("OUT_FP32") is not None
    client.close()


def test_a_bad_file_keeps_the_limits_in_force(http: httpx.Client, limits_file: Path) -> None:
    spend_the_burst(http)
    before = metric(http, "sluice_tenant_limits_reload_errors_total")
    replace(limits_file, "[tenants.team-a]\nrate = 'fast'\n")
    eventually(
        lambda: metric(http, "sluice_tenant_limits_reload_errors_total") > before,
        "the failed reload counted",
    )
    assert infer(http, KEY_A).status_code == 429
    assert metric(http, "sluice_tenant_limit", tenant="team-a", limit="burst") == 2
    replace(limits_file, "[tenants.nobody]\nrate = 5\n")  # unknown tenant: refused too
    eventually(
        lambda: metric(http, "sluice_tenant_limits_reload_errors_total") > before + 1,
        "the second failed reload counted",
    )
    assert infer(http, KEY_A).status_code == 429


def test_a_changed_file_applies_without_a_restart(http: httpx.Client, limits_file: Path) -> None:
    replace(limits_file, RELAXED)
    eventually(lambda: infer(http, KEY_A).status_code == 200, "team-a answered again")
    for _ in range(20):
        response = infer(http, KEY_A)
        assert response.status_code == 200, response.text
    assert metric(http, "sluice_tenant_limit", tenant="team-a", limit="rate") == 1000
    replace(limits_file, STRICT)  # back to strict: the new bucket starts full (2 tokens)
    eventually(
        lambda: metric(http, "sluice_tenant_limit", tenant="team-a", limit="burst") == 2,
        "the strict limits back in force",
    )
    statuses = [infer(http, KEY_A).status_code for _ in range(5)]
    assert 429 in statuses


SHARED_RATE = 40
"""team-b's rate on the two gateway processes."""


@pytest.fixture(scope="module")
def two_gateways(
    tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer
) -> Iterator[Stack]:
    yield from _tenants_stack(
        tmp_path_factory,
        redis_server,
        {
            "SLUICE_TENANT_LIMITS": (
                "[tenants.team-a]\nrate = 0.001\nburst = 4\n"
                f"[tenants.team-b]\nrate = {SHARED_RATE}\nburst = 4\n"
            ),
            "SLUICE_GATEWAY_PROCESSES": "2",
            "SLUICE_CATALOG_IDLE_REFRESH_S": "0.5",  # (idle, each refreshes every 0.5 s)
        },
    )


def test_gateway_processes_share_the_rate(two_gateways: Stack) -> None:
    """Each of two processes holds half the burst: however the connections spread, team-a
    gets 4 requests through, not 8."""
    with httpx.Client(base_url=two_gateways.url, timeout=30) as http:
        # (each process counts the host's two from its start, before either reports)
        eventually(lambda: metric(http, "sluice_gateway_processes") == 2, "both gateways reporting")
    statuses = []
    for _ in range(16):  # a new connection each: the kernel spreads them over the processes
        with httpx.Client(base_url=two_gateways.url, timeout=30) as http:
            statuses.append(infer(http, KEY_A).status_code)
    assert set(statuses) <= {200, 429}
    assert 2 <= statuses.count(200) <= 4, statuses


def test_one_connection_gets_the_whole_rate_of_two_processes(two_gateways: Stack) -> None:
    """team-b sends 30 requests a second, under its rate of 40, on one kept-alive
    connection, so to one of the two processes: once the processes have reported where
    team-b's requests arrive, that process admits them all (an equal split would give it
    20 a second, two thirds of them)."""
    pace_s = 1 / 30

    def send(seconds: float) -> list[int]:
        statuses: list[int] = []
        due = time.monotonic()
        end = due + seconds
        while due < end:
            statuses.append(infer(http, KEY_B).status_code)
            due += pace_s
            now = time.monotonic()
            if now < due:
                time.sleep(due - now)
            else:
                due = now  # late (a busy machine): no catching up in a burst
        return statuses

    with httpx.Client(base_url=two_gateways.url, timeout=30) as http:
        eventually(lambda: metric(http, "sluice_gateway_processes") == 2, "both gateways reporting")
        send(3.0)  # (the demand is measured and reported every refresh, 0.5 s)
        statuses = send(5.0)
    assert set(statuses) <= {200, 429}, statuses
    admitted = statuses.count(200) / len(statuses)
    assert admitted >= 0.9, f"{statuses.count(429)} of {len(statuses)} refused"
