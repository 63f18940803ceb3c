"""OpenVINO models through a real stack: IR (converted at test time from the example ONNX
models) and ONNX read by OpenVINO, answers equal to onnxruntime in-process; a fixed-batch IR
is reshaped to serve batches; an unknown OpenVINO property names itself."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import onnxruntime as ort
import openvino as ov  # the openvino extra, part of the dev install: missing fails loudly
import pytest
import tritonclient.http as httpclient

from sluice.scheduler.executor.redis_server import RedisServer
from tests.integration.conftest import load_examples_builder
from tests.support.stack import Stack

MLP_IO = (
    'input [ { name: "input" data_type: TYPE_FP32 dims: [ 16 ] } ]\n'
    'output [ { name: "output" data_type: TYPE_FP32 dims: [ 4 ] } ]\n'
)
CNN_IO = (
    'input [ { name: "input" data_type: TYPE_FP32 dims: [ 3, 64, 64 ] } ]\n'
    'output [ { name: "output" data_type: TYPE_FP32 dims: [ 10 ] } ]\n'
)


def _model(root: Path, name: str, io: str, extra: str = "") -> Path:
    (root / name / "1").mkdir(parents=True)
    (root / name / "config.pbtxt").write_text(
        f'name: "{name}"\nbackend: "openvino"\nmax_batch_size: 8\n{io}'
        "instance_group [ { kind: KIND_CPU } ]\n"
        f"dynamic_batching {{ max_queue_delay_microseconds: 2000 }}\n{extra}"
    )
    return root / name / "1"


@pytest.fixture(scope="module")
def onnx_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    builder = load_examples_builder()
    source = tmp_path_factory.mktemp("onnx")
    return {
        "mlp": builder.build_mlp(source / "mlp"),
        "cnn": builder.build_cnn(source / "cnn"),
    }


@pytest.fixture(scope="module")
def stack(
    tmp_path_factory: pytest.TempPathFactory, onnx_files: dict[str, Path], redis_server: RedisServer
) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("openvino")
    # Weights kept in FP32 (save_model compresses them to FP16 unless told not to).
    cnn = ov.convert_model(str(onnx_files["cnn"]))
    ov.save_model(cnn, str(_model(root, "cnn_ir", CNN_IO) / "model.xml"), compress_to_fp16=False)
    onnx_dir = _model(root, "mlp_onnx", MLP_IO, 'default_model_filename: "model.onnx"\n')
    (onnx_dir / "model.onnx").write_bytes(onnx_files["mlp"].read_bytes())
    fixed = ov.convert_model(str(onnx_files["mlp"]), input=[1, 16])  # batch fixed at 1
    ov.save_model(
        fixed, str(_model(root, "mlp_fixed_ir", MLP_IO) / "model.xml"), compress_to_fp16=False
    )
    bad = 'parameters { key: "NOT_AN_OPENVINO_PROPERTY" value: { string_value: "1" } }\n'
    ov.save_model(
        fixed, str(_model(root, "bad_property", MLP_IO, bad) / "model.xml"), compress_to_fp16=False
    )
    stack = Stack(root, redis_server.url)
    stack.start()
    yield stack
    stack.stop()


def _in_process(path: Path, rows: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(None, {"input": rows})[0]  # type: ignore[no-any-return]


def _infer(address: str, model: str, rows: np.ndarray) -> np.ndarray:
    with httpclient.InferenceServerClient(address) as client:
        tensor = httpclient.InferInput("input", list(rows.shape), "FP32")
        tensor.set_data_from_numpy(rows)
        return client.infer(model, [tensor]).as_numpy("output")  # type: ignore[no-any-return]


@pytest.mark.parametrize(
    ("model", "source", "shape"),
    [
        ("cnn_ir", "cnn", (2, 3, 64, 64)),
        ("mlp_onnx", "mlp", (5, 16)),
        ("mlp_fixed_ir", "mlp", (3, 16)),
    ],
)
def test_served_answers_equal_onnxruntime_in_process(
    stack: Stack, onnx_files: dict[str, Path], model: str, source: str, shape: tuple[int, ...]
) -> None:
    rows = np.random.default_rng(5).standard_normal(shape).astype(np.float32)
    answer = _infer(stack.address, model, rows)
    np.testing.assert_allclose(answer, _in_process(onnx_files[source], rows), rtol=1e-3, atol=1e-4)


def test_concurrent_requests_share_batches(stack: Stack, onnx_files: dict[str, Path]) -> None:
    rows = np.random.default_rng(6).standard_normal((32, 16)).astype(np.float32)
    with ThreadPoolExecutor(8) as pool:
        answers = list(
            pool.map(
                lambda i: _infer(stack.address, "mlp_fixed_ir", rows[i : i + 1]), range(len(rows))
            )
        )
    expected = _in_process(onnx_files["mlp"], rows)
    np.testing.assert_allclose(np.concatenate(answers), expected, rtol=1e-3, atol=1e-4)


def test_an_unknown_property_makes_the_model_unavailable_with_its_name(stack: Stack) -> None:
    index = httpx.post(f"{stack.url}/v2/repository/index", json={}).json()
    reasons = {row["name"]: row.get("reason", "") for row in index}
    assert reasons["cnn_ir"] == ""
    assert "NOT_AN_OPENVINO_PROPERTY" in reasons["bad_property"]
