"""Version labels and traffic split against a real stack: a model serving versions 1 and 2,
two gateway processes, API keys. Label routes, header and parameter; a 90/10 split over
1,000 requests; a change seen at once by the gateway that took it and within a second by
the other; management auth; bad inputs; the ``sluice routing`` command."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest
from redis import Redis

from sluice.core.keys import Keys
from sluice.scheduler.executor.redis_server import RedisServer
from tests.support.onnx_models import write_identity
from tests.support.stack import Stack

MODEL = "versioned"
INFER_KEY = "routing-infer-key"
ADMIN_KEY = "routing-admin-key"
ROUTING = f"/v2/repository/models/{MODEL}/routing"
BODY = {"inputs": [{"name": "IN_FP32", "shape": [1, 3], "datatype": "FP32", "data": [1, 2, 3]}]}
INFER = {"Authorization": f"Bearer {INFER_KEY}"}
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("routing")
    model_dir = write_identity(root, MODEL, ["FP32"], extra="version_policy: { all { } }")
    shutil.copytree(model_dir / "1", model_dir / "2")
    stack = Stack(
        root,
        redis_server.url,
        env={
            "SLUICE_GATEWAY_PROCESSES": "2",
            "SLUICE_API_KEYS": INFER_KEY,
            "SLUICE_ADMIN_KEYS": ADMIN_KEY,
        },
    )
    stack.start()
    yield stack
    stack.stop()


@pytest.fixture
def http(stack: Stack) -> Iterator[httpx.Client]:
    """One keep-alive connection: every request reaches the same gateway process."""
    with httpx.Client(base_url=stack.url, timeout=30) as client:
        assert client.delete(ROUTING, headers=ADMIN).status_code == 200
        yield client
        client.delete(ROUTING, headers=ADMIN)


def infer(
    http: httpx.Client, path: str = "", headers: dict[str, str] | None = None, **body: Any
) -> httpx.Response:
    return http.post(
        f"/v2/models/{MODEL}{path}/infer",
        content=orjson.dumps({**BODY, **body}),
        headers={**INFER, **(headers or {})},
    )


def served_by(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    version: str = response.json()["model_version"]
    return version


def set_labels(http: httpx.Client, **labels: int) -> dict[str, Any]:
    response = http.put(ROUTING, json={"labels": labels}, headers=ADMIN)
    assert response.status_code == 200, response.text
    answer: dict[str, Any] = response.json()
    return answer


def test_both_versions_serve_and_no_split_means_the_highest(http: httpx.Client) -> None:
    assert served_by(infer(http, "/versions/1")) == "1"
    assert served_by(infer(http, "/versions/2")) == "2"
    assert {served_by(infer(http)) for _ in range(20)} == {"2"}


def test_a_label_in_the_url_the_header_or_the_parameter(http: httpx.Client) -> None:
    answer = set_labels(http, production=1, staging=2)
    assert answer == {"model": MODEL, "labels": {"production": 1, "staging": 2}, "weights": {}}
    assert served_by(infer(http, "/labels/production")) == "1"
    assert served_by(infer(http, "/labels/staging")) == "2"
    assert served_by(infer(http, headers={"Sluice-Version-Label": "production"})) == "1"
    assert served_by(infer(http, parameters={"version_label": "production"})) == "1"
    assert served_by(infer(http, parameters={"version_label": "staging"})) == "2"
    same = infer(http, "/labels/production", {"Sluice-Version-Label": "production"})
    assert served_by(same) == "1"
    metadata = http.get(f"/v2/models/{MODEL}/labels/production", headers=INFER)
    assert metadata.status_code == 200 and metadata.json()["versions"] == ["1"]
    ready = http.get(f"/v2/models/{MODEL}/labels/staging/ready", headers=INFER)
    assert (ready.status_code, ready.content) == (200, b"")
    # Numeric versions are untouched by labels.
    assert served_by(infer(http, "/versions/2")) == "2"
    assert served_by(infer(http)) == "2"


def test_unknown_invalid_and_conflicting_labels_are_refused(http: httpx.Client) -> None:
    set_labels(http, production=1)
    for response in (
        infer(http, "/labels/nope"),
        infer(http, headers={"Sluice-Version-Label": "nope"}),
        infer(http, parameters={"version_label": "nope"}),
        http.get(f"/v2/models/{MODEL}/labels/nope", headers=INFER),
    ):
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert "'nope' is not a label of model 'versioned' (labels: production)" in error
    bad = infer(http, headers={"Sluice-Version-Label": "Not A Label"})
    assert bad.status_code == 400 and "must match [a-z0-9]" in bad.json()["error"]
    not_text = infer(http, parameters={"version_label": 1})
    assert not_text.status_code == 400
    assert "parameter 'version_label' must be a string" in not_text.json()["error"]
    for response in (
        infer(http, "/versions/1", {"Sluice-Version-Label": "production"}),
        infer(http, "/labels/production", {"Sluice-Version-Label": "other"}),
        infer(http, "/versions/2", parameters={"version_label": "production"}),
        infer(
            http, headers={"Sluice-Version-Label": "production"}, parameters={"version_label": "b"}
        ),
    ):
        assert response.status_code == 400, response.text
        assert "name the version one way" in response.json()["error"]
    ready = http.get(f"/v2/models/{MODEL}/labels/nope/ready", headers=INFER)
    assert ready.status_code == 400
    unknown_model = http.post(
        "/v2/models/nothing/labels/production/infer", json=BODY, headers=INFER
    )
    assert unknown_model.status_code == 404


def test_a_label_naming_a_version_no_longer_served_is_503(stack: Stack, http: httpx.Client) -> None:
    """Labels are checked when set; one left over from an older repository answers 503."""
    assert stack.redis_url is not None
    with Redis.from_url(stack.redis_url) as redis:
        redis.hset(Keys(stack.namespace).routing(MODEL), mapping={"label:old": "7"})
    time.sleep(1.0)  # the gateways' next refresh
    response = infer(http, "/labels/old")
    assert response.status_code == 503, response.text
    error = response.json()["error"]
    assert "'versioned' version label 'old' names version 7, which is not served" in error
    ready = http.get(f"/v2/models/{MODEL}/labels/old/ready", headers=INFER)
    assert ready.status_code == 400 and "Model version not ready" in ready.json()["error"]


def test_a_90_10_split_over_1000_requests(http: httpx.Client) -> None:
    response = http.put(ROUTING, json={"weights": {"1": 90, "2": 10}}, headers=ADMIN)
    assert response.status_code == 200, response.text
    assert response.json()["weights"] == {"1": 90, "2": 10}
    counts = Counter(served_by(infer(http)) for _ in range(1000))
    # Binomial(1000, 0.1): standard deviation 9.5; ±45 is beyond 4.7 of them.
    assert set(counts) == {"1", "2"} and abs(counts["2"] - 100) <= 45, counts
    # Requests naming a version (or a label) are not split.
    assert {served_by(infer(http, "/versions/2")) for _ in range(20)} == {"2"}
    # Labels and weights are separate parts: setting one keeps the other.
    assert set_labels(http, production=1)["weights"] == {"1": 90, "2": 10}
    cleared = http.put(ROUTING, json={"weights": {}}, headers=ADMIN)
    assert cleared.json() == {"model": MODEL, "labels": {"production": 1}, "weights": {}}
    assert {served_by(infer(http)) for _ in range(20)} == {"2"}


def test_a_change_is_seen_at_once_here_and_within_a_second_elsewhere(
    stack: Stack, http: httpx.Client
) -> None:
    assert stack.redis_url is not None
    with Redis.from_url(stack.redis_url) as redis:
        gateways = redis.zcard(Keys(stack.namespace).gateways)
    assert gateways == 2, "the stack should run two gateway processes"
    for version in (1, 2, 1, 2, 1):
        set_labels(http, production=version)
        # The same connection, so the same gateway process: no refresh in between.
        assert served_by(infer(http, "/labels/production")) == str(version)
    set_labels(http, production=2)
    time.sleep(1.0)
    # Fresh connections land on either process (40 of them all on one: about 2^-39).
    for _ in range(40):
        with httpx.Client(base_url=stack.url, timeout=30) as fresh:
            assert served_by(infer(fresh, "/labels/production")) == "2"


def test_the_routing_endpoints_need_the_admin_key(stack: Stack, http: httpx.Client) -> None:
    calls = [
        ("GET", ROUTING, None),
        ("PUT", ROUTING, {"labels": {"production": 1}}),
        ("DELETE", ROUTING, None),
        ("PUT", f"{ROUTING}/labels/production", {"version": 1}),
        ("DELETE", f"{ROUTING}/labels/production", None),
    ]
    for method, path, body in calls:
        content = None if body is None else orjson.dumps(body)
        missing = http.request(method, path, content=content)
        assert missing.status_code == 401, missing.text
        refused = http.request(method, path, content=content, headers=INFER)
        assert refused.status_code == 403, refused.text
        assert "use an admin key" in refused.json()["error"]
        allowed = http.request(method, path, content=content, headers=ADMIN)
        assert allowed.status_code == 200, allowed.text
    # The label routes are inference routes: inference keys, never none.
    set_labels(http, production=1)
    assert infer(http, "/labels/production", headers={"Authorization": ""}).status_code == 401
    assert http.get(f"/v2/models/{MODEL}/labels/production").status_code == 401


@pytest.mark.parametrize(
    ("method", "path", "body", "status", "message"),
    [
        ("PUT", ROUTING, b"{", 400, "malformed request body"),
        ("PUT", ROUTING, b"[]", 400, "request body must be a JSON object"),
        ("PUT", ROUTING, b"{}", 400, "the body names 'labels', 'weights' or both"),
        ("PUT", ROUTING, b'{"label": {}}', 400, "unknown field 'label'"),
        ("PUT", ROUTING, b'{"labels": {"Prod": 1}}', 400, "'labels': 'Prod' is not a valid"),
        ("PUT", ROUTING, b'{"labels": {"prod": "1"}}', 400, "'labels.prod' must be a model"),
        ("PUT", ROUTING, b'{"labels": {"prod": 3}}', 400, "version 3 of model 'versioned' is not"),
        ("PUT", ROUTING, b'{"weights": {"1": 1001}}', 400, "'weights.1' must be an integer"),
        ("PUT", ROUTING, b'{"weights": {"1": -5}}', 400, "'weights.1' must be an integer"),
        ("PUT", ROUTING, b'{"weights": {"x": 5}}', 400, "'weights' key 'x' must be a model"),
        ("PUT", ROUTING, b'{"weights": {"3": 5}}', 400, "version 3 of model 'versioned' is not"),
        ("PUT", ROUTING, b'{"weights": {"1": 0}}', 400, "at least one version a weight above 0"),
        (
            "PUT",
            ROUTING,
            orjson.dumps({"labels": {f"l{i}": 1 for i in range(17)}}),
            400,
            "a model may have 16",
        ),
        ("PUT", f"{ROUTING}/labels/prod", b'{"version": 9}', 400, "version 9 of model"),
        ("PUT", f"{ROUTING}/labels/prod", b'{"v": 1}', 400, '{"version": <version>}'),
        ("PUT", f"{ROUTING}/labels/prod", b'{"version": true}', 400, "'version' must be a model"),
        ("PUT", f"{ROUTING}/labels/Prod%20X", b'{"version": 1}', 400, "is not a valid label"),
        ("DELETE", f"{ROUTING}/labels/{'x' * 64}", None, 400, "is not a valid label"),
        ("GET", "/v2/repository/models/nothing/routing", None, 404, "'nothing' is not found"),
        ("PUT", "/v2/repository/models/nothing/routing", b"{}", 404, "'nothing' is not found"),
    ],
)
def test_bad_routing_requests_are_refused_naming_the_field(
    http: httpx.Client, method: str, path: str, body: bytes | None, status: int, message: str
) -> None:
    response = http.request(method, path, content=body, headers=ADMIN)
    assert response.status_code == status, response.text
    assert message in response.json()["error"]
    assert http.get(ROUTING, headers=ADMIN).json() == {"model": MODEL, "labels": {}, "weights": {}}


def test_labels_per_model_are_capped_one_at_a_time_too(http: httpx.Client) -> None:
    set_labels(http, **{f"l{i}": 1 for i in range(16)})
    more = http.put(f"{ROUTING}/labels/l16", json={"version": 2}, headers=ADMIN)
    assert more.status_code == 400 and "has 16 labels already" in more.json()["error"]
    moved = http.put(f"{ROUTING}/labels/l0", json={"version": 2}, headers=ADMIN)
    assert moved.status_code == 200 and moved.json()["labels"]["l0"] == 2


def sluice_routing(
    stack: Stack, *args: str, key: str = ADMIN_KEY
) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "SLUICE_API_KEY": key}
    return subprocess.run(
        [sys.executable, "-m", "sluice.cli", "routing", *args, "--url", stack.url],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )


def test_the_sluice_routing_command(stack: Stack, http: httpx.Client) -> None:
    done = sluice_routing(stack, "set-label", MODEL, "production", "1")
    assert done.returncode == 0, done.stderr
    assert orjson.loads(done.stdout)["labels"] == {"production": 1}
    done = sluice_routing(stack, "set-weights", MODEL, "1=90", "2=10")
    assert done.returncode == 0, done.stderr
    shown = sluice_routing(stack, "show", MODEL)
    assert orjson.loads(shown.stdout) == {
        "model": MODEL,
        "labels": {"production": 1},
        "weights": {"1": 90, "2": 10},
    }
    # The command talked to either gateway process; this one sees it within a refresh.
    deadline = time.monotonic() + 5
    while infer(http, "/labels/production").status_code != 200 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert served_by(infer(http, "/labels/production")) == "1"
    refused = sluice_routing(stack, "set-weights", MODEL, "1=5000")
    assert refused.returncode == 1 and "'weights.1' must be an integer" in refused.stderr
    not_admin = sluice_routing(stack, "show", MODEL, key=INFER_KEY)
    assert not_admin.returncode == 1 and "error 403" in not_admin.stderr
    assert sluice_routing(stack, "remove-label", MODEL, "production").returncode == 0
    cleared = sluice_routing(stack, "clear", MODEL)
    assert cleared.returncode == 0
    assert orjson.loads(cleared.stdout) == {"model": MODEL, "labels": {}, "weights": {}}
