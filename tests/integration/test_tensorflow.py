"""TensorFlow SavedModel and frozen GraphDef models through a real stack: answers equal
TensorFlow in-process, BYTES tensors included; a missing signature or tensor is named."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import tensorflow as tf  # the tensorflow extra, part of the dev install: missing fails loudly
import tritonclient.http as httpclient
from tensorflow.python.framework.convert_to_constants import (
    convert_variables_to_constants_v2,
)

from sluice.scheduler.executor.redis_server import RedisServer
from tests.support.stack import Stack

W = np.arange(8, dtype=np.float32).reshape(4, 2) / 10
B = np.array([0.5, -0.5], dtype=np.float32)


class Affine(tf.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = tf.Variable(W)
        self.b = tf.Variable(B)

    @tf.function(input_signature=[tf.TensorSpec([None, 4], tf.float32, name="x")])
    def serve(self, x: tf.Tensor) -> dict[str, tf.Tensor]:
        return {"y": tf.matmul(x, self.w) + self.b}

    @tf.function(input_signature=[tf.TensorSpec([None, 1], tf.string, name="text")])
    def shout(self, text: tf.Tensor) -> dict[str, tf.Tensor]:
        return {"loud": tf.strings.upper(text)}


def _config(name: str, platform: str, io: str, extra: str = "") -> str:
    return (
        f'name: "{name}"\nplatform: "{platform}"\nmax_batch_size: 8\n{io}'
        "dynamic_batching { max_queue_delay_microseconds: 1000 }\n" + extra
    )


AFFINE_IO = (
    'input [ { name: "x" data_type: TYPE_FP32 dims: [ 4 ] } ]\n'
    'output [ { name: "y" data_type: TYPE_FP32 dims: [ 2 ] } ]\n'
)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer) -> Iterator[Stack]:
    root: Path = tmp_path_factory.mktemp("tensorflow")
    module = Affine()
    saved = root / "affine_saved" / "1" / "model.savedmodel"
    tf.saved_model.save(
        module, str(saved), signatures={"serving_default": module.serve, "shout": module.shout}
    )
    (root / "affine_saved" / "config.pbtxt").write_text(
        _config("affine_saved", "tensorflow_savedmodel", AFFINE_IO)
    )
    shout_io = (
        'input [ { name: "text" data_type: TYPE_STRING dims: [ 1 ] } ]\n'
        'output [ { name: "loud" data_type: TYPE_STRING dims: [ 1 ] } ]\n'
    )
    (root / "shout" / "1").mkdir(parents=True)
    (root / "shout" / "1" / "model.savedmodel").symlink_to(saved, target_is_directory=True)
    (root / "shout" / "config.pbtxt").write_text(
        _config(
            "shout",
            "tensorflow_savedmodel",
            shout_io,
            'parameters { key: "TF_SIGNATURE_DEF" value: { string_value: "shout" } }\n',
        )
    )
    frozen = convert_variables_to_constants_v2(module.serve.get_concrete_function())
    graph_def = frozen.graph.as_graph_def()
    output_node = frozen.outputs[0].name.split(":")[0]
    input_node = frozen.inputs[0].name.split(":")[0]
    (root / "affine_graph" / "1").mkdir(parents=True)
    (root / "affine_graph" / "1" / "model.graphdef").write_bytes(graph_def.SerializeToString())
    graph_io = AFFINE_IO.replace('"x"', f'"{input_node}"').replace('"y"', f'"{output_node}"')
    (root / "affine_graph" / "config.pbtxt").write_text(
        _config("affine_graph", "tensorflow_graphdef", graph_io)
    )
    bad = _config(
        "no_signature",
        "tensorflow_savedmodel",
        AFFINE_IO,
        'parameters { key: "TF_SIGNATURE_DEF" value: { string_value: "missing" } }\n',
    )
    (root / "no_signature" / "1").mkdir(parents=True)
    (root / "no_signature" / "1" / "model.savedmodel").symlink_to(saved, target_is_directory=True)
    (root / "no_signature" / "config.pbtxt").write_text(bad)
    stack = Stack(root, redis_server.url)
    stack.start()
    stack.graph_names = (input_node, output_node)  # type: ignore[attr-defined]
    yield stack
    stack.stop()


def _infer(
    address: str, model: str, name: str, array: np.ndarray, datatype: str, out: str
) -> np.ndarray:
    with httpclient.InferenceServerClient(address) as client:
        tensor = httpclient.InferInput(name, list(array.shape), datatype)
        tensor.set_data_from_numpy(array)
        return client.infer(model, [tensor]).as_numpy(out)  # type: ignore[no-any-return]


def test_saved_model_and_graph_def_answer_as_tensorflow_in_process(stack: Stack) -> None:
    rows = np.random.default_rng(2).standard_normal((5, 4)).astype(np.float32)
    expected = rows @ W + B
    saved = _infer(stack.address, "affine_saved", "x", rows, "FP32", "y")
    np.testing.assert_allclose(saved, expected, rtol=1e-5, atol=1e-6)
    input_node, output_node = stack.graph_names  # type: ignore[attr-defined]
    graph = _infer(stack.address, "affine_graph", input_node, rows, "FP32", output_node)
    np.testing.assert_allclose(graph, expected, rtol=1e-5, atol=1e-6)


def test_a_named_signature_with_bytes_tensors(stack: Stack) -> None:
    text = np.array([[b"quiet"], [b"sluice"]], dtype=np.object_)
    loud = _infer(stack.address, "shout", "text", text, "BYTES", "loud")
    assert loud.tolist() == [[b"QUIET"], [b"SLUICE"]]


def test_a_missing_signature_is_named(stack: Stack) -> None:
    index = httpx.post(f"{stack.url}/v2/repository/index", json={}).json()
    reasons = {row["name"]: row.get("reason", "") for row in index}
    assert reasons["affine_saved"] == ""
    assert "has no signature 'missing'" in reasons["no_signature"]
