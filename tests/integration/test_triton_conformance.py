"""Same condition, Triton's answer: status codes and error texts that clients match on.

Each expected text below is Triton's own (server ``src/http_server.cc``,
``src/classification.cc``, ``src/common.cc``; core ``src/infer_request.cc``,
``src/model.cc``, ``src/model_repository_manager/*``, ``src/scheduler_utils.cc``); Sluice
may add detail after it. One stack serves a small repository of its own: the iris example
(classification with labels), identity models for BYTES and integer outputs, a broken
model, and a slow model whose queue holds one request.
"""

from __future__ import annotations

import re
import struct
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import numpy as np
import orjson
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from sluice.core.datatypes import serialize_bytes
from sluice.scheduler.executor.redis_server import RedisServer
from tests.integration.conftest import load_examples_builder
from tests.support.load import slow_request
from tests.support.onnx_models import write_identity
from tests.support.slow_model import write_slow
from tests.support.stack import Stack

ADMIN_KEY = "conformance-admin-key"
IRIS_ROWS = [[5.1, 3.5, 1.4, 0.2], [6.7, 3.0, 5.2, 2.3]]
SPECIES = (b"setosa", b"versicolor", b"virginica")
ANON = "[request id: <id_unknown>] "


@pytest.fixture(scope="module")
def conformance(
    tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer
) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("conformance")
    load_examples_builder().build_all(root, models=("iris",))
    write_identity(root, "bytes_one", ["BYTES"], dims=(1,))
    write_identity(root, "bytes_var", ["BYTES"], dims=(-1,))
    write_identity(root, "ints", ["INT32", "FP16"], dims=(4,))
    write_identity(root, "wide", ["FP32"], dims=(-1,), max_batch_size=0)
    broken = write_identity(root, "broken", ["FP32"])
    (broken / "1" / "model.onnx").write_bytes(b"not an onnx file")
    write_slow(
        root,
        "queued",
        extra="dynamic_batching { default_queue_policy { max_queue_size: 1 } }",
    )
    # No API keys: Triton's clients here send none (which route needs which key is
    # tests/integration/test_auth.py's); the admin key the management calls send is ignored.
    stack = Stack(root, redis_server.url)
    stack.start()
    yield stack
    stack.stop()


@pytest.fixture
def http(conformance: Stack) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=conformance.url, timeout=30) as client:
        yield client


@pytest.fixture
def client(conformance: Stack) -> Iterator[httpclient.InferenceServerClient]:
    with httpclient.InferenceServerClient(conformance.address) as triton:
        yield triton


def iris_input(binary: bool = True) -> httpclient.InferInput:
    tensor = httpclient.InferInput("input", [2, 4], "FP32")
    tensor.set_data_from_numpy(np.array(IRIS_ROWS, np.float32), binary_data=binary)
    return tensor


def error(response: httpx.Response, status: int) -> str:
    assert response.status_code == status, response.text
    message = response.json()["error"]
    assert isinstance(message, str)
    return message


def infer(http: httpx.Client, body: Any, model: str = "iris", **kwargs: Any) -> httpx.Response:
    content = body if isinstance(body, bytes) else orjson.dumps(body)
    return http.post(f"/v2/models/{model}/infer", content=content, **kwargs)


def iris_json(**extra: Any) -> dict[str, Any]:
    data = [v for row in IRIS_ROWS for v in row]
    return {
        "inputs": [{"name": "input", "shape": [2, 4], "datatype": "FP32", "data": data}]
    } | extra


# ------------------------------------------------------------------ 1. classification

CLASS = re.compile(rb"^(\d+\.\d{6}):(\d+):(setosa|versicolor|virginica)$")


def test_server_metadata_lists_tritons_extensions(client: httpclient.InferenceServerClient) -> None:
    assert client.get_server_metadata()["extensions"] == [  # Triton's, in its order
        "classification",
        "sequence",
        "model_repository",
        "model_repository(unload_dependents)",
        "schedule_policy",
        "model_configuration",
        "system_shared_memory",
        "cuda_shared_memory",
        "binary_tensor_data",
        "parameters",
        "statistics",
        "trace",
        "logging",
    ]


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_tritonclient_class_count_gives_top_classes_with_labels(
    client: httpclient.InferenceServerClient, binary: bool
) -> None:
    outputs = [
        httpclient.InferRequestedOutput("probabilities", binary_data=binary, class_count=2),
        httpclient.InferRequestedOutput("label", binary_data=binary),
    ]
    result = client.infer("iris", [iris_input()], outputs=outputs)
    response = result.get_response()
    described = {o["name"]: (o["datatype"], o["shape"]) for o in response["outputs"]}
    assert described == {"probabilities": ("BYTES", [2, 2]), "label": ("INT64", [2, 1])}
    classes = [
        [e.encode() if isinstance(e, str) else e for e in row]  # JSON strings come as str
        for row in result.as_numpy("probabilities")
    ]
    labels = result.as_numpy("label")[:, 0]
    for row, label in zip(classes, labels, strict=True):
        parsed = [CLASS.match(element) for element in row]
        assert all(parsed), row
        values = [float(m.group(1)) for m in parsed if m]
        indices = [int(m.group(2)) for m in parsed if m]
        names = [m.group(3) for m in parsed if m]
        assert values == sorted(values, reverse=True)
        assert names == [SPECIES[i] for i in indices]
        assert indices[0] == label  # the top class is the model's own label
    assert classes[0][0].startswith(b"0.9") and classes[0][0].endswith(b":0:setosa")


def test_curl_json_classification_and_count_beyond_the_classes(http: httpx.Client) -> None:
    body = iris_json(outputs=[{"name": "probabilities", "parameters": {"classification": 5}}])
    response = infer(http, body)
    assert response.status_code == 200, response.text
    [output] = response.json()["outputs"]
    assert (output["datatype"], output["shape"]) == ("BYTES", [2, 3])  # min(5, 3 classes)
    assert all(CLASS.match(element.encode()) for element in output["data"])
    zero = iris_json(outputs=[{"name": "probabilities", "parameters": {"classification": 0}}])
    [plain] = infer(http, zero).json()["outputs"]
    assert (plain["datatype"], plain["shape"]) == ("FP32", [2, 3])


def test_integer_output_classes_and_unsupported_datatypes(http: httpx.Client) -> None:
    ints = {"name": "IN_INT32", "shape": [1, 4], "datatype": "INT32", "data": [3, 9, -2, 9]}
    halves = {"name": "IN_FP16", "shape": [1, 4], "datatype": "FP16", "data": [0, 0, 0, 0]}
    body = {
        "inputs": [ints, halves],
        "outputs": [{"name": "OUT_INT32", "parameters": {"classification": 3}}],
    }
    [output] = infer(http, body, "ints").json()["outputs"]
    assert (output["shape"], output["data"]) == ([1, 3], ["9:1", "9:3", "3:0"])

    body["outputs"] = [{"name": "OUT_FP16", "parameters": {"classification": 1}}]
    message = error(infer(http, body, "ints"), 400)
    assert message.startswith(
        "class result not available for output due to unsupported type 'FP16'"
    )
    text = {"name": "IN_BYTES", "shape": [1, 1], "datatype": "BYTES", "data": ["a"]}
    strings = {
        "inputs": [text],
        "outputs": [{"name": "OUT_BYTES", "parameters": {"classification": 1}}],
    }
    message = error(infer(http, strings, "bytes_one"), 400)
    assert message.startswith(
        "class result not available for output due to unsupported type 'BYTES'"
    )


def test_classification_cannot_go_to_shared_memory(http: httpx.Client) -> None:
    output = {
        "name": "probabilities",
        "parameters": {
            "classification": 1,
            "shared_memory_region": "r",
            "shared_memory_byte_size": 64,
        },
    }
    message = error(infer(http, iris_json(outputs=[output])), 400)
    assert message.startswith("Output can't set both 'shared_memory_region' and 'classification'")


# ---------------------------------------------- 2. models, versions, inputs, outputs


def test_unknown_model_and_versions(
    http: httpx.Client, client: httpclient.InferenceServerClient
) -> None:
    with pytest.raises(InferenceServerException) as info:
        client.infer("nope", [iris_input()])
    assert info.value.status() == "404"
    assert info.value.message() == "Request for unknown model: 'nope' is not found"
    with pytest.raises(InferenceServerException) as info:
        client.get_model_metadata("iris", model_version="7")
    assert info.value.status() == "404"
    assert info.value.message() == "Request for unknown model: 'iris' version 7 is not found"

    # Triton's routes take [0-9]+ versions: anything else is an unknown path.
    for version in ("x1", "-1", "1.0"):
        assert error(http.get(f"/v2/models/iris/versions/{version}"), 404).startswith("Not Found")
    # Leading zeros are a number (std::stol); beyond int64 is a 400, never a 500.
    assert http.get("/v2/models/iris/versions/0001").json()["versions"] == ["1"]
    for digits in ("9" * 20, "7" * 5000):
        stol = (
            f"failed to get model version from specified version string '{digits}' "
            "(details: stol), version should be an integral value > 0"
        )
        assert error(http.get(f"/v2/models/iris/versions/{digits}"), 400) == stol
        assert error(infer(http, iris_json(), model=f"iris/versions/{digits}"), 400) == stol
        assert error(http.get(f"/v2/models/iris/versions/{digits}/ready"), 400) == stol


def test_model_that_failed_to_load(http: httpx.Client) -> None:
    """Triton's answers (core ``ModelLifeCycle::GetModel``): the version it tried is not at
    ready state (503); asked without a version, it has none available (404)."""
    body = {"inputs": [{"name": "IN_FP32", "shape": [1, 1], "datatype": "FP32", "data": [1]}]}
    message = error(http.post("/v2/models/broken/versions/1/infer", json=body), 503)
    assert message.startswith("Request for unknown model: 'broken' version 1 is not at ready state")
    assert error(http.get("/v2/models/broken/versions/1/config"), 503) == message
    assert error(http.get("/v2/models/broken/versions/2"), 404) == (
        "Request for unknown model: 'broken' version 2 is not found"
    )
    none_available = "Request for unknown model: 'broken' has no available versions"
    for answer in (infer(http, body, "broken"), http.get("/v2/models/broken")):
        assert error(answer, 404).startswith(none_available)
    ready = http.get("/v2/models/broken/ready")
    assert error(ready, 400).startswith(f"Model version not ready; {none_available}")


def test_input_and_output_names(http: httpx.Client) -> None:
    good = iris_json()["inputs"][0]
    message = error(infer(http, {"id": "r-9", "inputs": [good, good]}), 400)
    assert message == "[request id: r-9] input 'input' already exists in request"
    unknown = {**good, "name": "X"}
    message = error(infer(http, {"inputs": [unknown]}), 400)
    assert message.startswith("unexpected inference input 'X' for model 'iris'")
    message = error(infer(http, {"inputs": [good, unknown]}), 400)
    assert message.startswith(
        f"{ANON}expected 1 inputs but got 2 inputs for model 'iris'. "
        "Got input(s) ['input','X'], but missing required input(s) []."
    )
    two = {"name": "IN_INT32", "shape": [1, 4], "datatype": "INT32", "data": [1, 2, 3, 4]}
    message = error(infer(http, {"inputs": [two]}, "ints"), 400)
    assert message == (
        f"{ANON}expected 2 inputs but got 1 inputs for model 'ints'. Got input(s) "
        "['IN_INT32'], but missing required input(s) ['IN_FP16']. Please provide all "
        "required input(s)."
    )
    outputs = [{"name": "label"}, {"name": "label"}]
    message = error(infer(http, iris_json(outputs=outputs)), 400)
    assert message == f"{ANON}output 'label' already exists in request"
    message = error(infer(http, iris_json(outputs=[{"name": "nope"}])), 400)
    assert message.startswith("unexpected inference output 'nope' for model 'iris'")


def test_datatype_shape_and_batch_size(http: httpx.Client) -> None:
    good = iris_json()["inputs"][0]
    message = error(infer(http, {"inputs": [{**good, "datatype": "FP64"}]}), 400)
    assert message == (
        f"{ANON}inference input 'input' data-type is 'FP64', but model 'iris' expects 'FP32'"
    )
    wrong = {**good, "shape": [2, 5], "data": [0.0] * 10}
    message = error(infer(http, {"inputs": [wrong]}), 400)
    assert message.startswith(
        f"{ANON}unexpected shape for input 'input' for model 'iris'. Expected [-1,4], got [2,5]. "
        "NOTE: Setting a non-zero max_batch_size in the model config requires a batch dimension"
    )
    unbatched = {"name": "IN_FP32", "shape": [2, 3], "datatype": "FP32", "data": [0.0] * 6}
    message = error(infer(http, {"inputs": [unbatched]}, "wide"), 400)
    assert message == (
        f"{ANON}unexpected shape for input 'IN_FP32' for model 'wide'. "
        "Expected [-1], got [2,3]. "  # Triton's text ends so for a model without batching
    )
    big = {**good, "shape": [65, 4], "data": [0.0] * 260}
    message = error(infer(http, {"inputs": [big]}), 400)
    assert message.startswith(f"{ANON}inference request batch-size must be <= 64 for 'iris'")


def test_element_counts_and_byte_sizes(http: httpx.Client) -> None:
    good = iris_json()["inputs"][0]
    # JSON data of the wrong length: Triton's text (Triton answers it with a 500; Sluice 400).
    message = error(infer(http, {"inputs": [{**good, "data": [1.0] * 7}]}), 400)
    assert message.startswith(
        "Unable to parse 'data': Shape does not match true shape of 'data' field"
    )
    # JSON strings: Triton's core counts them.
    strings = {"name": "IN_BYTES", "shape": [2, 1], "datatype": "BYTES", "data": ["a"]}
    message = error(infer(http, {"inputs": [strings]}, "bytes_one"), 400)
    assert message == (
        f"{ANON}expected 2 string elements for inference input 'IN_BYTES' for model "
        "'bytes_one', got 1"
    )
    # binary_data_size against the shape, and against the body.
    header = orjson.dumps(
        {
            "inputs": [
                {
                    "name": "input",
                    "shape": [2, 4],
                    "datatype": "FP32",
                    "parameters": {"binary_data_size": 28},
                }
            ]
        }
    )
    response = infer(
        http, header + bytes(28), headers={"Inference-Header-Content-Length": str(len(header))}
    )
    assert error(response, 400).startswith(
        f"{ANON}input byte size mismatch for input 'input' for model 'iris'. Expected 32, got 28"
    )
    header = header.replace(b"28", b"32")
    response = infer(
        http, header + bytes(20), headers={"Inference-Header-Content-Length": str(len(header))}
    )
    assert error(response, 400).startswith(
        "unexpected size for input 'input', expecting 12 additional bytes for model 'iris'"
    )
    response = infer(
        http, header + bytes(36), headers={"Inference-Header-Content-Length": str(len(header))}
    )
    assert error(response, 400).startswith("unexpected additional input data for model 'iris'")
    # Binary strings: one element too many.
    two = serialize_bytes([b"x", b"y"])
    header = orjson.dumps(
        {
            "id": "s-1",
            "inputs": [
                {
                    "name": "IN_BYTES",
                    "shape": [1, 1],
                    "datatype": "BYTES",
                    "parameters": {"binary_data_size": len(two)},
                }
            ],
        }
    )
    response = infer(
        http,
        header + two,
        "bytes_one",
        headers={"Inference-Header-Content-Length": str(len(header))},
    )
    assert error(response, 400).startswith(
        "[request id: s-1] unexpected number of string elements 2 for inference input "
        "'IN_BYTES' for model 'bytes_one', expecting 1"
    )


# ----------------------------------------------------------------- 3. a full queue


def _computing(http: httpx.Client, model: str) -> bool:
    """Whether a worker of ``model`` holds a request (``sluice_pending_entries``)."""
    return any(
        line.startswith("sluice_pending_entries{")
        and f'model="{model}"' in line
        and float(line.rsplit(" ", 1)[1]) >= 1
        for line in http.get("/metrics").text.splitlines()
    )


def test_full_queue_is_503_with_tritons_text_and_retry_after(
    conformance: Stack, http: httpx.Client
) -> None:
    """``queued`` holds one request (max_queue_size 1): a second one while the first
    computes is refused at once."""
    first: dict[str, int] = {}

    def slow() -> None:
        with httpx.Client(base_url=conformance.url, timeout=60) as other:
            response = other.post("/v2/models/queued/infer", json=slow_request(1, 150_000))
            first["status"] = response.status_code

    thread = threading.Thread(target=slow)
    thread.start()
    try:
        # The others go once the first computes: sent sooner on a loaded machine, they
        # could take the queue's place before it and have it refused.
        deadline = time.monotonic() + 30
        while not _computing(http, "queued") and time.monotonic() < deadline:
            time.sleep(0.02)
        refused = None
        deadline = time.monotonic() + 10

        def second(_: int) -> httpx.Response:
            return http.post("/v2/models/queued/infer", json={**slow_request(2), "id": "q-2"})

        # A few at once: one may take the queue's place, the others find it full however
        # the first request and the worker's reads interleave on a loaded machine.
        with ThreadPoolExecutor(4) as pool:
            while refused is None and time.monotonic() < deadline and thread.is_alive():
                for response in pool.map(second, range(4)):
                    if response.status_code == 503:
                        refused = response
                time.sleep(0.05)
        assert refused is not None, "the second request was never refused"
        assert refused.headers["retry-after"].isdigit()
        assert error(refused, 503).startswith("[request id: q-2] Exceeds maximum queue size")
    finally:
        thread.join(60)
    assert first["status"] == 200


# ------------------------------------------------------------- 4. JSON nesting depth


def nest(value: Any, levels: int) -> Any:
    for _ in range(levels):
        value = [value]
    return value


def test_json_data_nested_100_deep_is_accepted_quickly_and_101_is_not(http: httpx.Client) -> None:
    rows = [0.5] * (64 * 4)
    body = {
        "inputs": [{"name": "input", "shape": [64, 4], "datatype": "FP32", "data": nest(rows, 99)}]
    }
    started = time.monotonic()
    response = infer(http, body)
    assert response.status_code == 200, response.text
    assert time.monotonic() - started < 2.0
    body["inputs"][0]["data"] = nest(rows, 100)
    assert "nested deeper than 100 levels" in error(infer(http, body), 400)
    # Far deeper than any limit (past what orjson writes, so written by hand): a quick 400.
    deep = b'{"inputs": [{"name": "input", "shape": [1, 4], "datatype": "FP32", "data": '
    deep += b"[" * 5000 + b"0.5" + b"]" * 5000 + b"}]}"
    started = time.monotonic()
    assert error(infer(http, deep), 400)
    assert time.monotonic() - started < 2.0


# ------------------------------------------------------------- 5. raw binary bodies


def raw(http: httpx.Client, model: str, body: bytes) -> httpx.Response:
    return infer(http, body, model, headers={"Inference-Header-Content-Length": "0"})


def test_raw_binary_bytes_input_needs_model_shape_one(http: httpx.Client) -> None:
    response = raw(http, "bytes_one", "the whole body, é".encode())
    assert response.status_code == 200, response.text
    length = int(response.headers["inference-header-content-length"])
    [output] = orjson.loads(response.content[:length])["outputs"]
    assert output["shape"] == [1, 1]  # batch of 1, model shape [1]
    expected = "the whole body, é".encode()
    assert response.content[length:] == struct.pack("<I", len(expected)) + expected
    message = error(raw(http, "bytes_var", b"abc"), 400)
    assert message.startswith(
        f"{ANON}For BYTE datatype raw input 'IN_BYTES', the model must have input shape [1]"
    )


def test_raw_binary_fixed_width_rules(http: httpx.Client) -> None:
    message = error(raw(http, "ints", bytes(16)), 400)
    assert message == (
        f"{ANON}Raw request must only have 1 input (found 1) to be deduced but got 2 inputs "
        "in 'ints' model configuration"
    )
    message = error(raw(http, "iris", bytes(12)), 400)
    assert message.startswith(
        f"{ANON}input byte size mismatch for input 'input' for model 'iris'. Expected 16, got 12"
    )
    response = raw(http, "wide", np.arange(6, dtype=np.float32).tobytes())
    assert response.status_code == 200, response.text
    length = int(response.headers["inference-header-content-length"])
    assert orjson.loads(response.content[:length])["outputs"][0]["shape"] == [6]


# ----------------------------------------------------------- 6. model load / unload


def test_load_and_unload_are_refused_as_triton_refuses_them_in_mode_none(
    conformance: Stack, http: httpx.Client
) -> None:
    not_allowed = "explicit model load / unload is not allowed if polling is enabled"
    for action in ("load", "unload"):
        path = f"/v2/repository/models/iris/{action}"
        headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
        assert error(http.post(path, headers=headers), 503).startswith(not_allowed)
        in_repository = f"/v2/repository/main/models/iris/{action}"
        message = error(http.post(in_repository, headers=headers), 501)
        assert message == "'repository_name' specification is not supported"
    with httpclient.InferenceServerClient(conformance.address) as triton:
        for call in (triton.load_model, triton.unload_model):
            with pytest.raises(InferenceServerException) as info:
                call("iris", headers={"Authorization": f"Bearer {ADMIN_KEY}"})
            assert info.value.status() == "503"
            assert info.value.message().startswith(not_allowed)
