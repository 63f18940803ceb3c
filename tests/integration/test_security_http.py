"""The HTTP edge under hostile clients: numbers, bodies, slow and idle connections.

Each test was a failing test before its fix: 500s from 5,000-digit numbers, a 200 MiB
body read whole by ``/v2/repository/index``, connections held open forever by clients that
send one byte at a time, and a 64 MiB body of BYTES elements counted on the event loop
while every other client waited. No Sluice process may die in any of them.
"""

from __future__ import annotations

import socket
import struct
import time
from collections.abc import Iterator

import httpx
import orjson
import pytest

from sluice.scheduler.executor.redis_server import RedisServer
from tests.integration.conftest import load_examples_builder
from tests.support.onnx_models import write_identity
from tests.support.procs import gateway_pids, wait_until, worker_pids
from tests.support.stack import Stack
from tests.support.stall import probe_while, stall_limit

HEADER_TIMEOUT_S = 1.0
BODY_TIMEOUT_S = 5.0
"""Long enough for a 64 MiB body on a machine busy with other work (the huge request below)."""
SEND_TIMEOUT_S = 1.0
MAX_CONNECTIONS = 40
CONTROL_LIMIT = 4096
MIB = 1 << 20
BUFFERED_LIMIT = 80 * MIB
MLP_INPUT = {"name": "input", "shape": [1, 16], "datatype": "FP32", "data": [0.5] * 16}


@pytest.fixture(scope="module")
def edge_stack(
    tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer
) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("edge")
    load_examples_builder().build_all(root, models=("mlp",))
    write_identity(root, "strings", ["BYTES"])
    stack = Stack(
        root,
        redis_server.url,
        env={
            "SLUICE_HEADER_TIMEOUT_S": str(HEADER_TIMEOUT_S),
            "SLUICE_BODY_TIMEOUT_S": str(BODY_TIMEOUT_S),
            "SLUICE_SEND_TIMEOUT_S": str(SEND_TIMEOUT_S),
            "SLUICE_MAX_CONNECTIONS": str(MAX_CONNECTIONS),
            "SLUICE_MAX_CONTROL_BODY_BYTES": str(CONTROL_LIMIT),
            "SLUICE_MAX_BUFFERED_BODY_BYTES": str(BUFFERED_LIMIT),
        },
        args=["--gateway-processes", "1"],  # (the connection and body limits are per process)
    )
    stack.start()
    assert stack.process is not None
    pids = {*gateway_pids(stack.process.pid), *worker_pids(stack.process.pid)}
    yield stack
    # No test may have killed a Sluice process.
    assert stack.process.poll() is None
    assert {*gateway_pids(stack.process.pid), *worker_pids(stack.process.pid)} == pids
    stack.stop()


@pytest.fixture
def http(edge_stack: Stack) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=edge_stack.url, timeout=10) as client:
        yield client


def _infer_ok(http: httpx.Client) -> None:
    response = http.post("/v2/models/mlp/infer", json={"inputs": [MLP_INPUT]})
    assert response.status_code == 200, response.text


def _error(response: httpx.Response) -> str:
    assert response.headers["content-type"] == "application/json", response.text
    message = response.json()["error"]
    assert isinstance(message, str)
    return message


def _connect(stack: Stack) -> socket.socket:
    return socket.create_connection(("127.0.0.1", stack.port), timeout=10)


def _read_all(sock: socket.socket) -> bytes:
    """Everything until the server closes the connection."""
    chunks = []
    try:
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    except ConnectionResetError:
        pass
    return b"".join(chunks)


# ---------------------------------------------------------------------- numbers


HUGE = "1" * 5000


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("POST", f"/v2/models/mlp/versions/{HUGE}/infer"),
        ("GET", f"/v2/models/mlp/versions/{HUGE}"),
        ("GET", f"/v2/models/mlp/versions/{HUGE}/ready"),
        ("GET", f"/v2/models/mlp/versions/{HUGE}/config"),
        ("GET", f"/v2/models/mlp/versions/{HUGE}/stats"),
    ],
)
def test_a_5000_digit_version_is_a_clean_4xx(http: httpx.Client, method: str, path: str) -> None:
    response = http.request(method, path, json={"inputs": [MLP_INPUT]})
    assert 400 <= response.status_code < 500, response.text
    assert "version" in _error(response)


@pytest.mark.parametrize("value", [HUGE, "12a", "-1", "1e3"])
def test_malformed_header_lengths_name_the_header(http: httpx.Client, value: str) -> None:
    response = http.post(
        "/v2/models/mlp/infer",
        content=orjson.dumps({"inputs": [MLP_INPUT]}),
        headers={"Inference-Header-Content-Length": value},
    )
    assert response.status_code == 400
    assert "Inference-Header-Content-Length" in _error(response)


def test_a_5000_digit_content_length_is_refused(edge_stack: Stack, http: httpx.Client) -> None:
    with _connect(edge_stack) as sock:
        sock.sendall(
            b"POST /v2/models/mlp/infer HTTP/1.1\r\nHost: x\r\nContent-Length: "
            + HUGE.encode()
            + b"\r\n\r\n{}"
        )
        answer = _read_all(sock)
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.split(b" ", 2)[1] in (b"400", b"413"), answer[:200]
    assert orjson.loads(body)["error"], body
    _infer_ok(http)


def test_malformed_http_gets_a_json_error(edge_stack: Stack) -> None:
    with _connect(edge_stack) as sock:
        sock.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\nBad Header\r\n\r\n")
        answer = _read_all(sock)
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400"), answer[:200]
    assert b"application/json" in head
    assert orjson.loads(body)["error"].startswith("malformed HTTP request")


@pytest.mark.parametrize(
    "parameters",
    [
        {"timeout": 10**30},
        {"priority": 10**30},
        {"timeout": -(10**30)},
    ],
)
def test_huge_request_parameters_are_400s(http: httpx.Client, parameters: dict[str, int]) -> None:
    body = b'{"parameters": {"%s": %d}, "inputs": [%s]}' % (
        next(iter(parameters)).encode(),
        next(iter(parameters.values())),
        orjson.dumps(MLP_INPUT),
    )
    response = http.post("/v2/models/mlp/infer", content=body)
    assert response.status_code == 400, response.text
    _error(response)


@pytest.mark.parametrize(
    "tensor",
    [
        b'{"name": "input", "shape": [1, 1%s], "datatype": "FP32", "data": [1]}' % (b"0" * 30),
        b'{"name": "input", "shape": [%d, 16], "datatype": "FP32", "data": [1]}' % 2**62,
        b'{"name": "input", "shape": [1, 16], "datatype": "FP32", "data": [1%s]}' % (b"0" * 400),
    ],
)
def test_huge_shapes_and_values_are_400s(http: httpx.Client, tensor: bytes) -> None:
    response = http.post("/v2/models/mlp/infer", content=b'{"inputs": [%s]}' % tensor)
    assert response.status_code == 400, response.text
    _error(response)


def test_a_huge_binary_data_size_is_a_400(http: httpx.Client) -> None:
    header = b'{"inputs": [{"name": "input", "shape": [1, 16], "datatype": "FP32", '
    header += b'"parameters": {"binary_data_size": %d}}]}' % 2**62
    response = http.post(
        "/v2/models/mlp/infer",
        content=header + b"\0" * 64,
        headers={"Inference-Header-Content-Length": str(len(header))},
    )
    assert response.status_code == 400, response.text
    assert "binary_data_size" in _error(response)


# ------------------------------------------------------------------- body limits


CONTROL_ROUTES = [
    ("POST", "/v2/repository/index"),
    ("POST", "/v2/systemsharedmemory/region/r/register"),
    ("POST", "/v2/systemsharedmemory/unregister"),
    ("POST", "/v2/cudasharedmemory/region/r/register"),
    ("POST", "/v2/repository/models/mlp/load"),
    ("GET", "/v2/health/live"),
    ("GET", "/v2/models/mlp"),
    ("GET", "/v2/models/stats"),
    ("POST", "/v2/no/such/route"),
]


@pytest.mark.parametrize(("method", "path"), CONTROL_ROUTES)
def test_every_route_refuses_a_declared_body_beyond_its_limit(
    edge_stack: Stack, method: str, path: str
) -> None:
    """Content-Length beyond the limit: 413 before a byte of the body is read, and the
    connection closed at once (the body it declared will never be read)."""
    with _connect(edge_stack) as sock:
        sock.sendall(
            f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {200 << 20}\r\n\r\n".encode()
        )
        answer = _read_all(sock)
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.split(b" ", 2)[1] == b"413", answer[:300]
    assert b"\r\nconnection: close" in head.lower()
    assert b"exceeds the limit" in body


@pytest.mark.parametrize(
    ("method", "path"), [CONTROL_ROUTES[0], CONTROL_ROUTES[1], CONTROL_ROUTES[3]]
)
def test_every_route_stops_reading_a_chunked_body_beyond_its_limit(
    http: httpx.Client, method: str, path: str
) -> None:
    """No Content-Length (chunked): counted as it arrives, 413 past the limit."""

    def chunks() -> Iterator[bytes]:
        yield b'{"key": "'
        for _ in range(64):
            yield b"x" * 1024

    response = http.request(method, path, content=chunks())
    assert response.status_code == 413, response.text
    assert "exceeds the limit" in _error(response)


def test_a_body_within_the_limit_still_works(http: httpx.Client) -> None:
    response = http.post("/v2/repository/index", json={"ready": True})
    assert response.status_code == 200
    assert {row["name"] for row in response.json()} == {"mlp", "strings"}


def _declare_body(stack: Stack, size: int) -> socket.socket:
    """A connection that announces an inference body of ``size`` bytes and sends none."""
    sock = _connect(stack)
    sock.sendall(
        b"POST /v2/models/mlp/infer HTTP/1.1\r\nHost: x\r\n"
        + f"Content-Length: {size}\r\n\r\n".encode()
    )
    return sock


def test_request_bodies_together_stay_within_the_gateway_budget(
    edge_stack: Stack, http: httpx.Client
) -> None:
    """Two 48 MiB bodies cannot be held at once under an 80 MiB budget: the second is a
    503 with Retry-After at once, and the budget is whole again once the first is gone."""
    first = _declare_body(edge_stack, 48 * MIB)
    try:
        time.sleep(0.2)  # the first has reserved its bytes
        with _declare_body(edge_stack, 48 * MIB) as second:
            answer = _read_all(second)
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503"), answer[:300]
        assert b"retry-after: 1" in head.lower()
        assert b"SLUICE_MAX_BUFFERED_BODY_BYTES" in body
        _infer_ok(http)  # small requests still fit
    finally:
        first.close()

    def accepted() -> bool:
        """Whether a third such body is accepted now: it waits for its body (no answer)."""
        with _declare_body(edge_stack, 48 * MIB) as third:
            third.settimeout(0.5)
            try:
                third.recv(1)  # (a refusal, the gateway not having seen the first go yet)
            except TimeoutError:
                return True
        return False

    # The first's bytes come back once the gateway has seen its client go.
    assert wait_until(accepted, 30), "the budget never came back whole"


# ------------------------------------------------------------------ slow clients


def test_a_client_sending_headers_byte_by_byte_is_cut_off(
    edge_stack: Stack, http: httpx.Client
) -> None:
    request = b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 200 + b"\r\n\r\n"
    with _connect(edge_stack) as sock:
        started = time.monotonic()
        closed_after = None
        for byte in request:
            try:
                sock.sendall(bytes([byte]))
            except (BrokenPipeError, ConnectionResetError):
                closed_after = time.monotonic() - started
                break
            _infer_ok(http)  # everyone else is served meanwhile
            time.sleep(0.05)
            if time.monotonic() - started > 4 * HEADER_TIMEOUT_S:
                break
        answer = _read_all(sock) if closed_after is None else b""
        closed_after = closed_after or time.monotonic() - started
    assert closed_after < HEADER_TIMEOUT_S + 1.5
    if answer:
        assert answer.startswith(b"HTTP/1.1 408"), answer[:200]


def test_an_idle_connection_is_closed_with_408(edge_stack: Stack) -> None:
    with _connect(edge_stack) as sock:
        started = time.monotonic()
        answer = _read_all(sock)
        waited = time.monotonic() - started
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert b"request headers not received" in answer
    assert HEADER_TIMEOUT_S - 0.2 < waited < HEADER_TIMEOUT_S + 1.5


def test_a_body_that_trickles_is_cut_off_and_never_queued(edge_stack: Stack) -> None:
    body = orjson.dumps({"inputs": [MLP_INPUT]})
    with _connect(edge_stack) as sock:
        sock.sendall(
            b"POST /v2/models/mlp/infer HTTP/1.1\r\nHost: x\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
        )
        started = time.monotonic()
        answer = b""
        for byte in body:
            try:
                sock.sendall(bytes([byte]))
            except (BrokenPipeError, ConnectionResetError):
                break
            time.sleep(0.1)  # 135 bytes: 13.5 s, well past the limit
            if time.monotonic() - started > 4 * BODY_TIMEOUT_S:
                break
        answer = _read_all(sock)
        waited = time.monotonic() - started
    assert answer == b"", answer[:200]
    assert waited < BODY_TIMEOUT_S + 1.5


def test_connections_beyond_the_cap_are_refused_and_others_recover(
    edge_stack: Stack, http: httpx.Client
) -> None:
    idle = [_connect(edge_stack) for _ in range(MAX_CONNECTIONS + 10)]
    try:
        time.sleep(0.3)
        refused = 0
        for sock in idle:
            sock.settimeout(0.2)
            try:
                refused += sock.recv(1) == b""
            except ConnectionResetError:
                refused += 1
            except TimeoutError:
                pass
        assert refused >= 10
    finally:
        for sock in idle:
            sock.close()
    # The idle ones are gone (closed by us, or by the header timeout): service as usual.
    _infer_ok(http)


def test_a_client_that_never_reads_its_answer_is_disconnected(edge_stack: Stack) -> None:
    """An 8 MiB answer to a client with a tiny receive window that reads nothing."""
    element = b"x" * (8 << 20)
    header = orjson.dumps(
        {
            "inputs": [
                {
                    "name": "IN_BYTES",
                    "shape": [1, 1],
                    "datatype": "BYTES",
                    "parameters": {"binary_data_size": 4 + len(element)},
                }
            ],
            "outputs": [{"name": "OUT_BYTES", "parameters": {"binary_data": True}}],
        }
    )
    body = header + struct.pack("<I", len(element)) + element
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.settimeout(10)
    sock.connect(("127.0.0.1", edge_stack.port))
    with sock:
        sock.sendall(
            b"POST /v2/models/strings/infer HTTP/1.1\r\nHost: x\r\n"
            + f"Inference-Header-Content-Length: {len(header)}\r\n".encode()
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        time.sleep(SEND_TIMEOUT_S + 3)  # the answer is computed, sent, stalls, times out
        received = len(_read_all(sock))
    assert 0 < received < len(element), received


# ----------------------------------------------------------------- the event loop


def _empty_strings_request(count: int) -> tuple[bytes, dict[str, str]]:
    header = orjson.dumps(
        {
            "inputs": [
                {
                    "name": "IN_BYTES",
                    "shape": [1, count + 1],  # one short: a 400 once all are counted
                    "datatype": "BYTES",
                    "parameters": {"binary_data_size": 4 * count},
                }
            ],
            "outputs": [{"name": "OUT_BYTES", "parameters": {"binary_data": True}}],
        }
    )
    body = header + struct.pack("<I", 0) * count
    return body, {"Inference-Header-Content-Length": str(len(header))}


def test_a_huge_bytes_request_does_not_stall_other_clients(
    edge_stack: Stack, http: httpx.Client
) -> None:
    """16 Mi empty BYTES elements (a 64 MiB body) are counted off the event loop."""
    body, headers = _empty_strings_request((16 << 20) - 1024)

    def send() -> int:
        with httpx.Client(base_url=edge_stack.url, timeout=120) as client:
            return client.post(
                "/v2/models/strings/infer", content=body, headers=headers
            ).status_code

    limit = stall_limit(edge_stack.url)
    probed = probe_while(edge_stack.url, send)
    assert probed.result == 400, probed.result
    assert probed.probes >= 5, "the big request finished too soon to measure anything"
    allowed = probed.stall_allowed_s(limit)
    assert probed.slowest_s < allowed, (
        f"a health probe took {probed.slowest_s:.2f} s during the big request "
        f"({probed.took_s:.2f} s; allowed {allowed:.2f} s)"
    )


def test_a_shape_of_more_dims_than_any_tensor_holds_is_refused_before_its_dims_are_read(
    http: httpx.Client,
) -> None:
    # A million dims is two megabytes of JSON; checking them and naming the shape in the
    # error took some fifty times that. A shape of more than numpy's 64 dims is refused first.
    dims = b",".join([b"1"] * 1_000_000)
    tensor = b'{"name": "input", "shape": [%s], "datatype": "FP32", "data": [1]}' % dims
    response = http.post("/v2/models/mlp/infer", content=b'{"inputs": [%s]}' % tensor)
    assert response.status_code == 400, response.text
    assert "'shape' has 1000000 dims, more than the limit of 64" in _error(response)
