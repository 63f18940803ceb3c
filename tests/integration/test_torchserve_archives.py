"""TorchServe model archives made with the real ``torch-model-archiver``, served through a
real stack and called with TorchServe's own API (``POST /predictions/{model}``): a
``BaseHandler`` subclass on a TorchScript model and a module with a ``handle`` function,
raw, JSON and multipart bodies, batching, and an error that fails only its own request."""

from __future__ import annotations

import functools
import http.server
import json
import threading
import time
import warnings
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from sluice.scheduler.executor.redis_server import RedisServer
from tests.support.model_files import save_torchscript
from tests.support.stack import Stack
from tests.support.torchserve_archives import import_mar, make_archive

LINEAR_HANDLER = '''
import json
import time

import torch
from ts.torch_handler.base_handler import BaseHandler


class LinearHandler(BaseHandler):
    """Rows of 4 numbers in (a JSON list per request), 2 numbers out per row."""

    def preprocess(self, data):
        time.sleep(0.02)  # a handler that takes a while: concurrent requests queue up
        rows = []
        for request in data:
            value = request.get("data") or request.get("body")
            if isinstance(value, (bytes, bytearray)):
                value = json.loads(value)
            rows.append(value)
        return torch.tensor(rows, dtype=torch.float32)

    def postprocess(self, output):
        size = output.shape[0]
        return [{"y": row, "batch": size} for row in output.tolist()]
'''

IMAGE_HANDLER = '''
import io

import numpy as np
import torch
from PIL import Image
from ts.torch_handler.base_handler import BaseHandler


class ImageClassifier(BaseHandler):
    """An image classifier as TorchServe's docs write one: PIL decodes, the TorchScript
    model scores, index_to_name.json (an extra file) names the top classes."""

    def preprocess(self, data):
        images = []
        for request in data:
            image = Image.open(io.BytesIO(request.get("data") or request.get("body")))
            pixels = np.asarray(image.convert("L").resize((8, 8)), dtype=np.float32)
            images.append(torch.from_numpy(pixels).reshape(1, 8, 8) / 255)
        return torch.stack(images)

    def postprocess(self, output):
        top = torch.softmax(output, dim=1).topk(2, dim=1)
        return [
            {self.mapping[str(i)]: p for i, p in zip(index.tolist(), value.tolist())}
            for value, index in zip(top.values, top.indices)
        ]
'''

TEXT_HANDLER = '''
import json
import os

import torch
from ts.torch_handler.base_handler import BaseHandler


class IntentClassifier(BaseHandler):
    """Like TorchServe's text classification example: a vocabulary (an extra file) turns
    words into ids, an EmbeddingBag model scores the intents."""

    def initialize(self, context):
        super().initialize(context)
        directory = context.system_properties.get("model_dir")
        with open(os.path.join(directory, "vocab.json")) as f:
            self.vocab = json.load(f)

    def preprocess(self, data):
        ids, offsets = [], []
        for request in data:
            text = request.get("data") or request.get("body")
            if isinstance(text, (bytes, bytearray)):
                text = text.decode()
            offsets.append(len(ids))
            ids += [self.vocab.get(word, 0) for word in text.lower().split()] or [0]
        return torch.tensor(ids), torch.tensor(offsets)

    def inference(self, data):
        with torch.no_grad():
            return self.model(*data)

    def postprocess(self, output):
        return [self.mapping[str(int(i))] for i in output.argmax(dim=1)]
'''

SHOUT_HANDLER = '''
def handle(data, context):
    """Text in, the same text in capitals out; "boom" fails (its own request only)."""
    if data is None:
        return None
    answers = []
    for request in data:
        text = request.get("body")
        text = text.decode() if isinstance(text, (bytes, bytearray)) else str(text)
        if "boom" in text:
            raise ValueError("cannot shout boom")
        answers.append(text.upper())
    return answers
'''


def _archive(
    tmp: Path, name: str, handler: str, serialized: Path | None, extra: tuple[Path, ...] = ()
) -> Path:
    return make_archive(tmp / "store", name, handler, serialized=serialized, extra=extra)


IMAGE_LABELS = {"0": "cat", "1": "dog", "2": "bird"}
INTENT_LABELS = {"0": "weather", "1": "music", "2": "alarm"}
VOCAB = {"rain": 1, "sunny": 2, "play": 3, "song": 4, "music": 5, "wake": 6, "alarm": 7}
INTENT_EXAMPLE = (torch.tensor([1, 2, 3]), torch.tensor([0, 2]))


class Intent(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embedding = torch.nn.EmbeddingBag(8, 6, mode="mean")
        self.score = torch.nn.Linear(6, 3)

    def forward(self, ids: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return self.score(self.embedding(ids, offsets))


def _image_model() -> torch.nn.Module:
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 3)).eval()


def _intent_model() -> torch.nn.Module:
    torch.manual_seed(2)
    return Intent().eval()


@pytest.fixture(scope="module")
def linear(tmp_path_factory: pytest.TempPathFactory) -> torch.jit.ScriptModule:
    torch.manual_seed(0)
    path = save_torchscript(
        torch.nn.Linear(4, 2).eval(),
        (torch.zeros(1, 4),),
        tmp_path_factory.mktemp("linear") / "model.pt",
    )
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", r"`torch\.jit", DeprecationWarning)
        return torch.jit.load(str(path))


@pytest.fixture(scope="module")
def stack(
    tmp_path_factory: pytest.TempPathFactory,
    linear: torch.jit.ScriptModule,
    redis_server: RedisServer,
) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("torchserve")
    weights = tmp / "model.pt"
    linear.save(str(weights))
    _archive(tmp, "linear", LINEAR_HANDLER, weights)
    _archive(tmp, "shout", SHOUT_HANDLER, None)
    for name, handler, module, example, mapping, extra in (
        ("image", IMAGE_HANDLER, _image_model(), (torch.zeros(1, 1, 8, 8),), IMAGE_LABELS, {}),
        (
            "intent",
            TEXT_HANDLER,
            _intent_model(),
            INTENT_EXAMPLE,
            INTENT_LABELS,
            {"vocab.json": VOCAB},
        ),
    ):
        files = tmp / f"{name}-files"
        files.mkdir()
        model_file = save_torchscript(module, example, files / "model.pt")
        (files / "index_to_name.json").write_text(json.dumps(mapping))
        for file_name, content in extra.items():
            (files / file_name).write_text(json.dumps(content))
        extras = tuple(p for p in files.iterdir() if p.suffix == ".json")
        _archive(tmp, name, handler, model_file, extras)
    # TorchServe's own configuration, with settings Sluice takes and one it does not.
    models = {
        "linear": {"1.0": {"defaultVersion": True, "batchSize": 8, "maxBatchDelay": 50}},
        "shout": {"1.0": {"batchSize": 4, "maxBatchDelay": 50, "minWorkers": 1}},
        "image": {"1.0": {"batchSize": 4, "maxBatchDelay": 20}},
        "intent": {"1.0": {"batchSize": 4, "maxBatchDelay": 20}},
    }
    (tmp / "config.properties").write_text(
        "inference_address=http://0.0.0.0:8080\n"
        "# a comment\n"
        f"models={json.dumps(models)}\n"
        "job_queue_size=500\n"
    )
    repository = tmp / "repository"
    imported = import_mar(
        str(tmp / "store"),
        "--model-repository",
        str(repository),
        "--config-properties",
        str(tmp / "config.properties"),
    )
    assert imported.returncode == 0, imported.stderr
    assert "model 'linear' ->" in imported.stdout and "model 'shout' ->" in imported.stdout
    assert "inference_address has no Sluice equivalent; ignored" in imported.stderr
    config = (repository / "linear" / "config.pbtxt").read_text()
    assert "max_batch_size: 8" in config and "max_queue_size: 500" in config
    stack = Stack(repository, redis_server.url, env={"SLUICE_TORCHSERVE_METRICS": "true"})
    stack.start()
    yield stack
    stack.stop()


def _expected(linear: torch.jit.ScriptModule, row: list[float]) -> list[float]:
    with torch.no_grad():
        return [float(v) for v in linear(torch.tensor([row]))[0]]


def test_a_base_handler_answers_as_in_process(stack: Stack, linear: torch.jit.ScriptModule) -> None:
    row = [1.0, 2.0, 3.0, 4.0]
    answer = httpx.post(f"{stack.url}/predictions/linear", json=row, timeout=30)
    assert answer.status_code == 200, answer.text
    assert answer.headers["content-type"].startswith("application/json")
    assert answer.json()["y"] == pytest.approx(_expected(linear, row), rel=1e-6)
    form = httpx.post(
        f"{stack.url}/predictions/linear/1.0",
        files={"data": ("row.json", json.dumps(row).encode(), "application/json")},
        timeout=30,
    )
    assert form.status_code == 200, form.text
    assert form.json()["y"] == pytest.approx(_expected(linear, row), rel=1e-6)


def test_concurrent_predictions_are_batched_and_kept_apart(
    stack: Stack, linear: torch.jit.ScriptModule
) -> None:
    rows = [[float(i), 1.0, -1.0, 0.5 * i] for i in range(32)]

    def one(row: list[float]) -> dict[str, object]:
        with httpx.Client(timeout=30) as client:
            answer = client.post(f"{stack.url}/predictions/linear", json=row)
            assert answer.status_code == 200, answer.text
            return answer.json()  # type: ignore[no-any-return]

    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(one, rows))
    for row, answer in zip(rows, answers, strict=True):
        assert answer["y"] == pytest.approx(_expected(linear, row), rel=1e-5, abs=1e-6)
    assert max(int(answer["batch"]) for answer in answers) > 1  # type: ignore[call-overload]


def test_a_function_handler_and_an_error_that_fails_only_its_request(stack: Stack) -> None:
    url = f"{stack.url}/predictions/shout"
    headers = {"content-type": "text/plain"}
    with ThreadPoolExecutor(8) as pool:
        texts = ["hello", "boom", "sluice", "again"] * 4
        answers = list(
            pool.map(lambda text: httpx.post(url, content=text, headers=headers, timeout=30), texts)
        )
    for text, answer in zip(texts, answers, strict=True):
        if text == "boom":  # (TorchServe's words; the handler's go to the worker's log)
            assert answer.status_code == 503
            assert answer.json() == {
                "code": 503,
                "type": "InternalServerException",
                "message": "Prediction failed",
            }
        else:
            assert answer.status_code == 200, answer.text
            assert answer.text == text.upper()


def test_the_same_model_answers_on_the_v2_route_and_unknown_models_say_so(stack: Stack) -> None:
    document = {
        "inputs": [
            {"name": "body", "shape": [1, 1], "datatype": "BYTES", "data": ["quiet"]},
            {"name": "content_type", "shape": [1, 1], "datatype": "BYTES", "data": ["text/plain"]},
        ]
    }
    answer = httpx.post(f"{stack.url}/v2/models/shout/infer", json=document, timeout=30)
    assert answer.status_code == 200, answer.text
    outputs = {o["name"]: o["data"] for o in answer.json()["outputs"]}
    assert outputs["response"] == ["QUIET"]
    missing = httpx.post(f"{stack.url}/predictions/nothing", content=b"x", timeout=30)
    assert missing.status_code == 404
    assert set(missing.json()) == {"code", "type", "message"}
    assert httpx.get(f"{stack.url}/ping").json() == {"status": "Healthy"}


def test_torchserve_s_metric_names_count_the_predictions(stack: Stack) -> None:
    before = _ts_requests(stack)
    for _ in range(3):
        assert httpx.post(f"{stack.url}/predictions/linear", json=[0, 0, 0, 1]).status_code == 200
    deadline = time.monotonic() + 10
    while _ts_requests(stack) < before + 3 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _ts_requests(stack) >= before + 3
    text = httpx.get(f"{stack.url}/metrics").text
    assert "# TYPE ts_inference_latency_microseconds counter" in text
    assert 'ts_queue_latency_microseconds{model_name="linear",model_version="1.0",' in text


def _ts_requests(stack: Stack) -> float:
    for line in httpx.get(f"{stack.url}/metrics").text.splitlines():
        if line.startswith('ts_inference_requests_total{model_name="linear"'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.fixture(scope="module")
def managed(
    tmp_path_factory: pytest.TempPathFactory, stack: Stack, redis_server: RedisServer
) -> Iterator[Stack]:
    """A stack in explicit model control with an empty repository and a model store holding
    the ``shout`` archive (built for ``stack``)."""
    tmp = tmp_path_factory.mktemp("managed")
    store = tmp / "store"
    store.mkdir()
    archive = stack.repository / "shout" / "1" / "model.mar"  # type: ignore[operator]
    (store / "shout.mar").write_bytes(archive.read_bytes())
    (tmp / "repository").mkdir()
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(store))
    files = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=files.serve_forever, daemon=True).start()
    managed = Stack(
        tmp / "repository",
        redis_server.url,
        env={
            "SLUICE_MODEL_STORE": str(store),
            "SLUICE_ALLOWED_MODEL_URLS": rf"http://127\.0\.0\.1:{files.server_port}/.*",
        },
        args=["--model-control-mode", "explicit"],
    )
    managed.start()
    managed.files_url = f"http://127.0.0.1:{files.server_port}"  # type: ignore[attr-defined]
    yield managed
    managed.stop()
    files.shutdown()
    files.server_close()


def test_the_management_api_registers_scales_describes_and_unregisters(managed: Stack) -> None:
    with httpx.Client(base_url=managed.url, timeout=120) as http:
        registered = http.post(
            "/models",
            params={
                "url": "shout.mar",
                "batch_size": 4,
                "max_batch_delay": 20,
                "initial_workers": 1,
            },
        )
        assert registered.status_code == 200, registered.text
        assert "registered with 1 initial workers" in registered.json()["status"]
        answer = http.post(
            "/predictions/shout", content="hi", headers={"content-type": "text/plain"}
        )
        assert answer.status_code == 200 and answer.text == "HI", answer.text
        assert {"modelName": "shout", "modelUrl": "shout.mar"} in http.get("/models").json()[
            "models"
        ]
        (described,) = http.get("/models/shout").json()
        assert described["batchSize"] == 4 and described["maxBatchDelay"] == 20
        assert [w["status"] for w in described["workers"]] == ["READY"]

        scaled = http.put(
            "/models/shout/1.0", params={"min_worker": 1, "max_worker": 2, "synchronous": "true"}
        )
        assert scaled.status_code == 200, scaled.text
        assert scaled.json()["status"] == "Workers scaled to 1 for model: shout, version: 1.0"
        (described,) = http.get("/models/shout/1.0").json()
        assert (described["minWorkers"], described["maxWorkers"]) == (1, 2)

        default = http.put("/models/shout/1.0/set-default")
        assert default.status_code == 200, default.text
        assert http.post("/predictions/shout", content="again").text == "AGAIN"

        assert http.delete("/models/shout/1.0").status_code == 200
        gone = http.post("/predictions/shout", content="x")
        assert gone.status_code in (404, 503) and set(gone.json()) == {"code", "type", "message"}


@pytest.mark.parametrize(
    ("url", "status", "fragment"),
    [
        ("../store/shout.mar", 404, "Relative path is not allowed in url"),
        ("https://example.com/m.mar", 404, "does not match any allowed URL"),
        ("file:///etc/passwd", 404, "does not match any allowed URL"),
        ("missing.mar", 404, "Model not found in model store: missing.mar"),
        ("", 404, "empty url"),
        ("x" * 300 + ".mar", 404, "Model not found in model store: xxx"),
        ("/etc/" + "x" * 5000, 404, "Model not found in model store: /etc/xxx"),
        ("a\0b.mar", 404, "Model not found in model store"),
        ("s3://bucket/m.mar", 404, "does not match any allowed URL"),
        ("http://169.254.169.254/latest/meta-data/", 404, "does not match any allowed URL"),
    ],
)
def test_registering_refuses_what_is_not_in_the_store(
    managed: Stack, url: str, status: int, fragment: str
) -> None:
    answer = httpx.post(f"{managed.url}/models", params={"url": url}, timeout=30)
    assert answer.status_code == status, answer.text
    assert fragment in answer.json()["message"]


def test_an_image_classifier_and_an_intent_classifier_answer_as_in_process(stack: Stack) -> None:
    import io

    from PIL import Image

    pixels = np.random.default_rng(3).integers(0, 256, (16, 16, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    answer = httpx.post(f"{stack.url}/predictions/image", content=buffer.getvalue(), timeout=30)
    assert answer.status_code == 200, answer.text
    gray = Image.open(io.BytesIO(buffer.getvalue())).convert("L").resize((8, 8))
    batch = torch.from_numpy(np.asarray(gray, dtype=np.float32)).reshape(1, 1, 8, 8) / 255
    with torch.no_grad():
        top = torch.softmax(_image_model()(batch), dim=1).topk(2, dim=1)
    expected = {
        IMAGE_LABELS[str(i)]: p
        for i, p in zip(top.indices[0].tolist(), top.values[0].tolist(), strict=True)
    }
    assert answer.json() == pytest.approx(expected, rel=1e-5)

    text = "play a song with music"
    intent = httpx.post(f"{stack.url}/predictions/intent", content=text, timeout=30)
    assert intent.status_code == 200, intent.text
    ids = torch.tensor([VOCAB.get(word, 0) for word in text.split()])
    with torch.no_grad():
        scores = _intent_model()(ids, torch.tensor([0]))
    assert intent.text == INTENT_LABELS[str(int(scores.argmax(dim=1)[0]))]


def test_an_archive_registers_from_a_url_the_operator_allows(managed: Stack) -> None:
    url = f"{managed.files_url}/shout.mar"  # type: ignore[attr-defined]
    with httpx.Client(base_url=managed.url, timeout=120) as http:
        registered = http.post("/models", params={"url": url, "model_name": "fetched"})
        assert registered.status_code == 200, registered.text
        answer = http.post(
            "/predictions/fetched", content="far", headers={"content-type": "text/plain"}
        )
        assert answer.text == "FAR"
        missing = http.post("/models", params={"url": f"{managed.files_url}/nothing.mar"})  # type: ignore[attr-defined]
        assert missing.status_code == 400, missing.text  # TorchServe's DownloadArchiveException
        assert "Failed to download archive from" in missing.json()["message"]
        assert http.delete("/models/fetched").status_code == 200


@pytest.mark.parametrize(
    ("method", "path", "params", "status", "fragment"),
    [
        ("PUT", "/models/nothing", {"min_worker": 1}, 404, "Model not found: nothing"),
        ("POST", "/models", {"url": "shout.mar", "batch_size": 0}, 400, "'batch_size' must be"),
        (
            "POST",
            "/models",
            {"url": "shout.mar", "max_batch_delay": 2_000_000},
            400,
            "'max_batch_delay' must be a whole number from 0 to 1000000, got 2000000",
        ),
        ("POST", "/models", {}, 400, "Parameter url is required."),
        ("GET", "/models/nothing", {}, 404, "Model not found: nothing"),
        ("DELETE", "/models/nothing/1", {}, 404, "Model not found: nothing"),
    ],
)
def test_bad_management_requests_say_what_is_wrong(
    managed: Stack, method: str, path: str, params: dict[str, object], status: int, fragment: str
) -> None:
    answer = httpx.request(method, f"{managed.url}{path}", params=params, timeout=30)
    assert answer.status_code == status, answer.text
    assert fragment in answer.json()["message"]


def test_bad_scale_and_default_values_say_what_is_wrong(stack: Stack) -> None:
    """On a stack whose models are loaded: explicit mode is not on there, so scaling is
    refused as Triton refuses loads; set-default names a version that is not served."""
    with httpx.Client(base_url=stack.url, timeout=30) as http:
        refused = http.put("/models/shout", params={"min_worker": 1})
        assert refused.status_code == 503 and "polling is enabled" in refused.json()["message"]
        unknown = http.put("/models/shout/7/set-default")
        assert unknown.status_code == 404
        assert unknown.json()["message"] == "Model version 7 does not exist for model shout"
        bad = http.put("/models/shout/v1.x/set-default")  # (a version TorchServe lacks)
        assert bad.status_code == 404
        assert bad.json() == {
            "code": 404,
            "type": "ModelVersionNotFoundException",
            "message": "Model version v1.x does not exist for model shout",
        }
