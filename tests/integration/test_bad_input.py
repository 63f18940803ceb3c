"""Bad requests get a precise 4xx over plain HTTP, and none of them reaches a worker."""

from __future__ import annotations

import gzip
import struct
from collections.abc import Iterator

import httpx
import orjson
import pytest
from redis import Redis

from sluice.core.keys import Keys
from tests.integration.conftest import BODY_LIMIT
from tests.support.stack import Stack

GOOD_INPUT = {"name": "input", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}
BINARY_HEADER = orjson.dumps(
    {
        "inputs": [
            {
                "name": "input",
                "shape": [1, 4],
                "datatype": "FP32",
                "parameters": {"binary_data_size": 16},
            }
        ]
    }
)
BINARY_DATA = struct.pack("<4f", 1, 2, 3, 4)


@pytest.fixture
def http(stack: Stack) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=stack.url, timeout=10) as client:
        yield client


@pytest.fixture
def queue_untouched(stack: Stack) -> Iterator[None]:
    """Asserts that the test added nothing to the iris request stream."""
    redis = Redis.from_url(stack.redis_url)
    key = Keys(stack.namespace).request_stream("iris", 1)
    before = redis.xinfo_stream(key)["entries-added"]
    yield
    assert redis.xinfo_stream(key)["entries-added"] == before
    redis.close()


def infer(
    http: httpx.Client, body: object, model: str = "iris", **kwargs: object
) -> httpx.Response:
    content = body if isinstance(body, bytes) else orjson.dumps(body)
    return http.post(f"/v2/models/{model}/infer", content=content, **kwargs)  # type: ignore[arg-type]


def error_of(response: httpx.Response) -> str:
    message = response.json()["error"]
    assert isinstance(message, str)
    return message


def test_good_request_passes(http: httpx.Client) -> None:
    response = infer(http, {"inputs": [GOOD_INPUT]})
    assert response.status_code == 200, response.text


def test_unknown_model_and_version_are_404(http: httpx.Client) -> None:
    assert infer(http, {"inputs": [GOOD_INPUT]}, model="nope").status_code == 404
    response = http.post(
        "/v2/models/iris/versions/7/infer", content=orjson.dumps({"inputs": [GOOD_INPUT]})
    )
    assert response.status_code == 404 and "7" in error_of(response)
    assert http.get("/v2/models/iris/versions/x1").status_code == 404
    assert http.get("/v2/models/nope").status_code == 404
    assert http.get("/v2/no/such/path").status_code == 404


@pytest.mark.usefixtures("queue_untouched")
@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"name": "inputs"}, "inputs"),
        ({"datatype": "INT32", "data": [1, 2, 3, 4]}, "data-type is 'INT32'"),
        ({"datatype": "FLOAT"}, "datatype"),
        ({"shape": [1, 5], "data": [1, 2, 3, 4, 5]}, "shape"),
        ({"shape": [4]}, "shape"),
        ({"shape": [65, 4], "data": [0.0] * 260}, "batch-size must be <= 64"),
        ({"data": [1, 2, 3]}, "element"),
        ({"data": [1, 2, "x", 4]}, "input"),
        ({"shape": [1, -4]}, "shape"),
    ],
)
def test_bad_input_is_400_naming_the_input(
    http: httpx.Client, change: dict[str, object], expected: str
) -> None:
    response = infer(http, {"inputs": [{**GOOD_INPUT, **change}]})
    assert response.status_code == 400, response.text
    message = error_of(response)
    assert expected in message
    if change.get("name") is None:
        assert "'input'" in message


@pytest.mark.usefixtures("queue_untouched")
@pytest.mark.parametrize(
    "body",
    [
        b"{not json",
        b"[1, 2]",
        b"",
        orjson.dumps({"inputs": []}),
        orjson.dumps({"inputs": [GOOD_INPUT, GOOD_INPUT]}),
        orjson.dumps({"inputs": [GOOD_INPUT], "outputs": [{"name": "nope"}]}),
        orjson.dumps({"inputs": [GOOD_INPUT], "parameters": {"triton_x": 1}}),
    ],
)
def test_malformed_body_is_400(http: httpx.Client, body: bytes) -> None:
    response = infer(http, body)
    assert response.status_code == 400, response.text
    assert error_of(response)


@pytest.mark.usefixtures("queue_untouched")
def test_bad_binary_header_is_400(http: httpx.Client) -> None:
    header, data = BINARY_HEADER, BINARY_DATA
    for value in ("abc", "-1", str(len(header) + 100)):
        response = infer(http, header + data, headers={"Inference-Header-Content-Length": value})
        assert response.status_code == 400, (value, response.text)
        assert "Inference-Header-Content-Length" in error_of(response) or "header" in error_of(
            response
        )
    short = infer(
        http, header + data[:-4], headers={"Inference-Header-Content-Length": str(len(header))}
    )
    assert short.status_code == 400 and "'input'" in error_of(short)


def test_good_binary_request_passes(http: httpx.Client) -> None:
    header, data = BINARY_HEADER, BINARY_DATA
    good = infer(http, header + data, headers={"Inference-Header-Content-Length": str(len(header))})
    assert good.status_code == 200, good.text


@pytest.mark.usefixtures("queue_untouched")
def test_body_over_the_limit_is_413(http: httpx.Client) -> None:
    response = infer(http, b"x" * (BODY_LIMIT + 1))
    assert response.status_code == 413
    bomb = gzip.compress(b" " * (BODY_LIMIT * 2))
    response = infer(http, bomb, headers={"Content-Encoding": "gzip"})
    assert response.status_code == 413


def test_gzip_request_body_is_accepted(http: httpx.Client) -> None:
    body = gzip.compress(orjson.dumps({"inputs": [GOOD_INPUT]}))
    response = infer(http, body, headers={"Content-Encoding": "gzip"})
    assert response.status_code == 200, response.text


def test_wrong_method_is_405(http: httpx.Client) -> None:
    response = http.get("/v2/models/iris/infer")
    assert response.status_code == 405
    assert error_of(response)
