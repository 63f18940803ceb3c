"""Fuzzing the running gateway over real HTTP (issue 4: never a 500, never a hang).

Hypothesis builds requests by mutating valid ones (wrong types, huge or negative
shapes, deep nesting, odd datatypes, unicode names, random parameters, duplicated
keys), binary-protocol bodies with random ``Inference-Header-Content-Length`` values
and tails, arbitrary bytes, and random header values and model names. For every
case: the status is below 500 (503 only from the models that are unavailable on
purpose, 504 only for a request whose own ``timeout`` parameter ran out), an error
has a JSON body with an ``error`` string, and the answer comes within 5 s.
Afterwards the gateway is the same process and still serves.
"""

from __future__ import annotations

import gzip
import json
import struct
import time
import zlib
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import quote

import httpx
import orjson
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from tests.support import procs
from tests.support.onnx_models import ALL_DATATYPES
from tests.support.stack import Stack

pytestmark = pytest.mark.timeout(240)

IDENTITY_TYPES = [dt for dt in ALL_DATATYPES if dt != "BF16"]
UNAVAILABLE = {"broken_config", "corrupt_model"}
"""Models of the test repository that are broken on purpose: 503 'unavailable' is right."""
MODELS = ["iris", "identity", "nobatch", "identity_bf16", *UNAVAILABLE, "nope", "ïris", ""]
DATATYPE_NAMES = [*ALL_DATATYPES, "FLOAT", "fp32", "", "TYPE_FP32", "STRING", "INT128", "ÄÖ"]
VERSIONS = ["", "", "", "/versions/1", "/versions/2", "/versions/01", "/versions/x"]
VERSIONS += [
    "/versions/%C2%B2",
    "/versions/%D9%A3",
    "/versions/-1",
    "/versions/99999999999999999999",
]
"""Version path segments; ``%C2%B2`` (²) and ``%D9%A3`` (٣) are str.isdigit() but not ASCII."""
MAX_SECONDS = 5.0

FUZZ = settings(
    deadline=None,
    database=None,
    phases=[Phase.explicit, Phase.generate, Phase.shrink],
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.filter_too_much,
    ],
)

# ------------------------------------------------------------------ strategies

json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=12)
)
json_values = st.recursive(
    json_scalars,
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=12,
)
odd_ints = st.one_of(
    st.integers(-3, 10),
    st.integers(-(2**64), 2**64),
    st.sampled_from([2**31, 2**32, 2**63 - 1, 2**63, 2**64 - 1, 2**64, 2**26, 2**26 + 1]),
)
odd_shapes = st.lists(odd_ints, max_size=5) | json_values
names = st.text(max_size=12) | st.sampled_from(
    ["input", "IN_FP32", "OUT_FP32", "label", "x" * 70_000]
)


def _int_range(datatype: str) -> tuple[int, int]:
    bits = int("".join(c for c in datatype if c.isdigit()))
    if datatype.startswith("U"):
        return 0, 2**bits - 1
    return -(2 ** (bits - 1)), 2 ** (bits - 1) - 1


def _elements(datatype: str) -> st.SearchStrategy[Any]:
    if datatype == "BOOL":
        return st.booleans()
    if datatype == "BYTES":
        return st.text(max_size=6)
    if datatype.startswith(("INT", "UINT")):
        low, high = _int_range(datatype)
        return st.integers(low, high)
    return st.floats(-1e3, 1e3, width=16 if datatype == "FP16" else 32)


@st.composite
def valid_requests(draw: st.DrawFn) -> tuple[str, dict[str, Any]]:
    """A valid request for one of the served models: (model, body)."""
    model = draw(st.sampled_from(["iris", "identity", "nobatch"]))
    body: dict[str, Any]
    if model == "iris":
        batch = draw(st.integers(1, 3))
        data = draw(st.lists(_elements("FP32"), min_size=4 * batch, max_size=4 * batch))
        body = {
            "inputs": [{"name": "input", "shape": [batch, 4], "datatype": "FP32", "data": data}]
        }
        outputs = ["label", "probabilities"]
    elif model == "identity":
        datatype = draw(st.sampled_from(IDENTITY_TYPES))
        count = draw(st.integers(1, 4))
        data = draw(st.lists(_elements(datatype), min_size=count, max_size=count))
        inputs = [
            {"name": f"IN_{datatype}", "shape": [1, count], "datatype": datatype, "data": data}
        ]
        for other in IDENTITY_TYPES:  # the model needs every input
            if other != datatype:
                example = {"BOOL": True, "BYTES": "a"}.get(other, 1)
                inputs.append(
                    {"name": f"IN_{other}", "shape": [1, 1], "datatype": other, "data": [example]}
                )
        body = {"inputs": inputs}
        outputs = [f"OUT_{datatype}"]
    else:
        data = draw(st.lists(_elements("FP32"), min_size=6, max_size=6))
        body = {"inputs": [{"name": "IN_FP32", "shape": [2, 3], "datatype": "FP32", "data": data}]}
        outputs = ["OUT_FP32"]
    if draw(st.booleans()):
        body["outputs"] = [
            {"name": name, "parameters": {"binary_data": draw(st.booleans())}}
            for name in draw(st.lists(st.sampled_from(outputs), max_size=2, unique=True))
        ]
    if draw(st.booleans()):
        body["id"] = draw(st.text(max_size=10))
    if draw(st.booleans()):
        body["parameters"] = {"timeout": draw(st.integers(0, 5_000_000))}
    return model, body


def _containers(value: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    """Paths of every dict and list in a JSON document (the root is ())."""
    if isinstance(value, dict | list):
        yield path
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, child in items:
            yield from _containers(child, (*path, key))


def _at(document: Any, path: tuple[Any, ...]) -> Any:
    for key in path:
        document = document[key]
    return document


MUTATIONS = [
    "replace",
    "delete",
    "add",
    "datatype",
    "shape",
    "name",
    "nest",
    "duplicate_input",
    "parameters",
    "data_type_swap",
]


@st.composite
def mutated_requests(draw: st.DrawFn) -> tuple[str, bytes]:
    """A valid request with 0-3 mutations, serialised in one of several ways: (path, body)."""
    model, body = draw(valid_requests())
    for _ in range(draw(st.integers(0, 3))):
        containers = list(_containers(body))
        target = _at(body, draw(st.sampled_from(containers)))
        mutation = draw(st.sampled_from(MUTATIONS))
        inputs = body.get("inputs") if isinstance(body, dict) else None
        first = (
            inputs[0]
            if isinstance(inputs, list) and inputs and isinstance(inputs[0], dict)
            else None
        )
        if mutation == "replace" and target:
            key = draw(
                st.sampled_from(list(target) if isinstance(target, dict) else range(len(target)))
            )
            target[key] = draw(json_values)
        elif mutation == "delete" and target:
            key = draw(
                st.sampled_from(list(target) if isinstance(target, dict) else range(len(target)))
            )
            del target[key]
        elif mutation == "add":
            if isinstance(target, dict):
                target[draw(st.text(max_size=10))] = draw(json_values)
            else:
                target.append(draw(json_values))
        elif first is not None and mutation == "datatype":
            first["datatype"] = draw(st.sampled_from(DATATYPE_NAMES))
        elif first is not None and mutation == "shape":
            first["shape"] = draw(odd_shapes)
        elif first is not None and mutation == "name":
            first["name"] = draw(names)
        elif first is not None and mutation == "nest":
            depth = draw(st.sampled_from([2, 3, 33, 100, 600]))
            data: Any = first.get("data", [1])
            for _ in range(depth):
                data = [data]
            first["data"] = data
        elif inputs is not None and first is not None and mutation == "duplicate_input":
            inputs.append(dict(first))
        elif mutation == "parameters":
            holder = first if first is not None and draw(st.booleans()) else body
            if isinstance(holder, dict):
                holder["parameters"] = draw(
                    st.dictionaries(
                        st.sampled_from(
                            [
                                "timeout",
                                "priority",
                                "binary_data_output",
                                "binary_data_size",
                                "triton_x",
                                "shared_memory_region",
                                "classification",
                                "x",
                            ]
                        )
                        | st.text(max_size=6),
                        json_values,
                        max_size=3,
                    )
                )
        elif first is not None and mutation == "data_type_swap":
            first["data"] = draw(st.lists(json_scalars, max_size=6))
    version = draw(st.sampled_from(VERSIONS))
    target_model = draw(st.sampled_from([model] * 6 + MODELS))
    path = f"/v2/models/{quote(target_model, safe='')}{version}/infer"
    style = draw(st.sampled_from(["json", "ascii", "utf8", "duplicate_key", "trailing", "deep"]))
    if style == "json":
        text = json.dumps(body)
    elif style == "ascii":
        text = json.dumps(body, ensure_ascii=True, indent=draw(st.sampled_from([None, 1])))
    elif style == "utf8":
        return path, json.dumps(body, ensure_ascii=False).encode("utf-8", "surrogatepass")
    elif style == "duplicate_key":
        text = json.dumps(body)
        if text.startswith("{") and len(text) > 2:
            key = draw(st.sampled_from(["inputs", "outputs", "id", "parameters"]))
            text = "{" + json.dumps(key) + ": " + json.dumps(draw(json_values)) + ", " + text[1:]
    elif style == "trailing":
        text = json.dumps(body) + draw(st.sampled_from(["", " ", "x", "{}", "\x00", "]"]))
    else:
        depth = draw(st.sampled_from([64, 1000, 5000, 100_000]))
        text = '{"inputs": ' + "[" * depth + "]" * depth + "}"
    return path, text.encode("utf-8", "surrogatepass")


@st.composite
def binary_requests(draw: st.DrawFn) -> tuple[str, bytes, dict[str, str]]:
    """Binary-protocol requests: a JSON header whose inputs announce binary_data_size,
    a tail of random (or right-sized) bytes, and a random header length."""
    model, body = draw(valid_requests())
    tail = b""
    for tensor in body["inputs"]:
        data = tensor.pop("data")
        datatype = tensor["datatype"]
        if datatype == "BYTES":
            exact = b"".join(struct.pack("<I", len(s.encode())) + s.encode() for s in data)
        elif datatype == "BOOL":
            exact = bytes(bool(x) for x in data)
        else:
            size = {"8": 1, "16": 2, "32": 4, "64": 8}[
                datatype.lstrip("ABCDEFGHIJKLMNOPQRSTUVWXYZ")
            ]
            exact = b"\x00" * size * len(data)
        chunk = draw(st.sampled_from([exact, exact, b""]) | st.binary(max_size=40))
        declared = draw(
            st.sampled_from([len(exact), len(exact), len(chunk)])
            | st.integers(-5, 100)
            | st.sampled_from([2**31, 2**63, 2**64, 10**30])
            | json_scalars
        )
        tensor["parameters"] = {"binary_data_size": declared}
        tail += chunk
    if draw(st.booleans()):
        body["parameters"] = {"binary_data_output": draw(st.booleans() | json_scalars)}
    header = json.dumps(body).encode()
    tail += draw(st.sampled_from([b"", b"", b"\x00", b"\xff" * 3]) | st.binary(max_size=16))
    content = header + tail
    length = draw(
        st.sampled_from([str(len(header))] * 4 + ["0", "", "-1", "1e3", "0x10", "+5", "1_0"])
        | latin1
        | st.integers(0, len(content) + 10).map(str)
        | st.integers(-(2**70), 2**70).map(str)
        | printable
    )
    headers = {"Inference-Header-Content-Length": length}
    return f"/v2/models/{model}/infer", content, headers


printable = st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=24).map(str.strip)
"""Header values HTTP allows: printable ASCII without surrounding spaces."""
latin1 = st.text(
    st.characters(min_codepoint=0xA0, max_codepoint=0xFF), min_size=1, max_size=4
) | st.sampled_from(["\u00b2", "1\u00b9", "\u00b3\u00b2", "\u00bd"])
"""Header bytes 0xA0-0xFF (sent as Latin-1): superscript digits are str.isdigit()."""


@st.composite
def odd_header_requests(draw: st.DrawFn) -> tuple[str, str, bytes, dict[str, str]]:
    """Random model names on every model endpoint, and random values of the headers the
    gateway reads: (method, path, body, headers)."""
    model = draw(st.sampled_from(MODELS) | st.text(max_size=12))
    suffix = draw(st.sampled_from(VERSIONS)) + draw(
        st.sampled_from(["", "/ready", "/config", "/stats", "/infer"])
    )
    method = (
        "POST" if suffix.endswith("infer") else draw(st.sampled_from(["GET", "GET", "POST", "PUT"]))
    )
    _, valid = draw(valid_requests())
    content = json.dumps(valid).encode() if method != "GET" else b""
    headers: dict[str, str] = {}
    for name in draw(
        st.lists(
            st.sampled_from(
                [
                    "Content-Encoding",
                    "Content-Type",
                    "Inference-Header-Content-Length",
                    "Authorization",
                    "Accept",
                    "Transfer-Encoding-X",
                    "X-Request-Id",
                ]
            ),
            max_size=4,
            unique=True,
        )
    ):
        headers[name] = draw(
            printable
            | st.sampled_from(["gzip", "deflate", "br", "identity", "GZIP", "Bearer", "Bearer x"])
            | latin1
        )
    if headers.get("Content-Encoding", "").strip().lower() == "gzip" and draw(st.booleans()):
        content = gzip.compress(content)
    return method, f"/v2/models/{quote(model, safe='')}{suffix}", content, headers


# ---------------------------------------------------------------------- checks


@pytest.fixture(scope="module")
def http(stack: Stack) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=stack.url, timeout=MAX_SECONDS + 5) as client:
        yield client


@pytest.fixture(scope="module")
def gateway(stack: Stack) -> list[int]:
    """The gateway processes (as many as ``--gateway-processes auto`` started)."""
    assert stack.process is not None
    return procs.gateway_pids(stack.process.pid)


Checker = Callable[..., None]


@pytest.fixture
def check(
    http: httpx.Client,
    gateway: list[int],
    record_property: Callable[[str, Any], None],
    request: pytest.FixtureRequest,
) -> Iterator[Checker]:
    """Sends one case and checks the answer; afterwards reports the figures and checks
    that the gateway is the same process and still serves."""
    statuses: Counter[str] = Counter()
    slowest = [0.0]
    spent = [0.0]

    def send(
        method: str, path: str, content: bytes = b"", headers: dict[str, str] | None = None
    ) -> None:
        started = time.monotonic()
        raw_headers = {k: v.encode("latin-1") for k, v in (headers or {}).items()}
        case = f"{method} {path} headers={headers} body={content[:300]!r}"
        try:
            response = http.request(method, path, content=content, headers=raw_headers)
        except httpx.HTTPError as exc:
            statuses["no answer"] += 1
            raise AssertionError(f"no HTTP answer ({exc!r}) for {case}") from None
        elapsed = time.monotonic() - started
        statuses[str(response.status_code)] += 1
        slowest[0] = max(slowest[0], elapsed)
        spent[0] += elapsed
        assert elapsed < MAX_SECONDS, f"{elapsed:.1f} s for {case}"
        status = response.status_code
        unavailable_model = any(
            path == f"/v2/models/{m}" or path.startswith(f"/v2/models/{m}/") for m in UNAVAILABLE
        )
        # 503 is right for the models broken on purpose; 504 for a request whose own
        # 'timeout' parameter (microseconds) is shorter than the work.
        asked_timeout = b'"timeout"' in content and (
            b"within" in response.content or b"deadline would pass" in response.content
        )
        assert (
            status < 500
            or (status == 503 and unavailable_model)
            or (status == 504 and asked_timeout)
        ), f"{status} {response.text[:300]} for {case}"
        if status >= 400:
            try:
                error = orjson.loads(response.content)["error"]
            except (orjson.JSONDecodeError, KeyError, TypeError):
                error = None
            assert isinstance(error, str) and error, (
                f"{status} without a JSON error: {response.text[:200]!r} for {case}"
            )

    yield send

    figures = {
        "cases": sum(statuses.values()),
        "statuses": dict(sorted(statuses.items())),
        "slowest_s": round(slowest[0], 3),
        "http_s": round(spent[0], 1),
    }
    print(f"\n[{request.node.name}] {json.dumps(figures)}")
    for name, value in figures.items():
        record_property(name, value)
    assert all(procs.alive(pid) for pid in gateway), "a gateway process died"
    good = {
        "inputs": [{"name": "input", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}]
    }
    assert http.post("/v2/models/iris/infer", content=orjson.dumps(good)).status_code == 200
    assert http.get("/v2/models/iris/ready").status_code == 200


def test_fuzz_json_requests(check: Checker) -> None:
    @settings(FUZZ, max_examples=1500)
    @given(case=mutated_requests())
    def run(case: tuple[str, bytes]) -> None:
        check("POST", case[0], case[1])

    run()


def test_fuzz_binary_requests(check: Checker) -> None:
    @settings(FUZZ, max_examples=1000)
    @given(case=binary_requests())
    def run(case: tuple[str, bytes, dict[str, str]]) -> None:
        check("POST", case[0], case[1], case[2])

    run()


def test_fuzz_arbitrary_bytes(check: Checker) -> None:
    @settings(FUZZ, max_examples=300)
    @given(
        body=st.binary(max_size=2048),
        path=st.sampled_from(
            [
                "/v2/models/iris/infer",
                "/v2/models/identity/infer",
                "/v2/models/nobatch/infer",
                "/v2/repository/index",
            ]
        ),
        encoding=st.sampled_from([None, None, "gzip", "deflate"]),
        length=st.none() | st.integers(0, 2100).map(str),
        compress=st.booleans(),
    )
    def run(
        body: bytes, path: str, encoding: str | None, length: str | None, compress: bool
    ) -> None:
        headers = {}
        if encoding:
            headers["Content-Encoding"] = encoding
            if compress:
                body = gzip.compress(body) if encoding == "gzip" else zlib.compress(body)
        if length is not None:
            headers["Inference-Header-Content-Length"] = length
        check("POST", path, body, headers)

    run()


def test_fuzz_headers_and_model_names(check: Checker) -> None:
    @settings(FUZZ, max_examples=300)
    @given(case=odd_header_requests())
    def run(case: tuple[str, str, bytes, dict[str, str]]) -> None:
        check(*case)

    run()


def test_keep_alive_answers_are_not_delayed(stack: Stack) -> None:
    """Small answers on one keep-alive connection come at once. (A listening socket that
    uvicorn takes as AF_UNIX gets no TCP_NODELAY on its connections: then every answer
    whose head and body go out as two writes waits ~40 ms for the client's delayed ACK,
    and this fuzzing would take minutes instead of seconds.)"""
    timings = []
    with httpx.Client(base_url=stack.url, timeout=5) as http:
        for _ in range(30):
            started = time.monotonic()
            assert http.get("/v2/health/live").status_code == 200
            timings.append(time.monotonic() - started)
    median_ms = sorted(timings)[len(timings) // 2] * 1000
    print(f"\n[test_keep_alive_answers_are_not_delayed] median {median_ms:.1f} ms")
    assert median_ms < 20, f"median {median_ms:.1f} ms for GET /v2/health/live on one connection"
