"""Triton's own Python client, unchanged, against a running Sluice."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.integration.conftest import Path
from tests.support.onnx_models import ALL_DATATYPES
from tests.support.stack import Stack

RNG = np.random.default_rng(7)


def sample(datatype: str, shape: tuple[int, ...]) -> np.ndarray:
    if datatype == "BOOL":
        return RNG.integers(0, 2, shape).astype(bool)
    if datatype == "BYTES":
        values = [f"s{i}-\u00e9".encode() for i in range(int(np.prod(shape)))]
        values[0] = b"with\x00nul"
        return np.array(values, dtype=np.object_).reshape(shape)
    if datatype == "BF16":
        import ml_dtypes

        return RNG.standard_normal(shape).astype(ml_dtypes.bfloat16)
    if datatype in ("FP16", "FP32", "FP64"):
        return RNG.standard_normal(shape).astype(datatype_np(datatype))
    info = np.iinfo(datatype_np(datatype))
    return RNG.integers(info.min, info.max, shape, dtype=datatype_np(datatype), endpoint=True)


def datatype_np(datatype: str) -> type:
    from tritonclient.utils import triton_to_np_dtype

    return triton_to_np_dtype(datatype)


@pytest.fixture
def client(stack: Stack):  # type: ignore[no-untyped-def]
    with httpclient.InferenceServerClient(stack.address) as client:
        yield client


def test_health_and_server_metadata(client: httpclient.InferenceServerClient) -> None:
    assert client.is_server_live()
    # The shared stack serves two broken models: Triton's strict readiness says not ready.
    assert not client.is_server_ready()
    metadata = client.get_server_metadata()
    assert metadata["name"] == "sluice"
    assert "binary_tensor_data" in metadata["extensions"]


def test_model_metadata_and_config(client: httpclient.InferenceServerClient) -> None:
    assert client.is_model_ready("iris")
    assert client.is_model_ready("iris", "1")
    assert not client.is_model_ready("broken_config")
    metadata = client.get_model_metadata("iris")
    assert metadata["versions"] == ["1"]
    assert metadata["platform"] == "onnxruntime_onnx"
    assert metadata["inputs"] == [{"name": "input", "datatype": "FP32", "shape": [-1, 4]}]
    config = client.get_model_config("iris")
    assert config["max_batch_size"] == 64
    assert config["input"][0]["data_type"] == "TYPE_FP32"
    assert config["input"][0]["dims"] == [4]
    assert config["dynamic_batching"]["max_queue_delay_microseconds"] == 500


@pytest.mark.parametrize("binary", [True, False])
def test_iris_matches_in_process_onnxruntime(
    client: httpclient.InferenceServerClient, repository: Path, binary: bool
) -> None:
    from sklearn.datasets import load_iris

    features = load_iris().data.astype(np.float32)[:40]
    session = ort.InferenceSession(str(repository / "iris" / "1" / "model.onnx"))
    expected_label, expected_proba = session.run(["label", "probabilities"], {"input": features})

    request = httpclient.InferInput("input", list(features.shape), "FP32")
    request.set_data_from_numpy(features, binary_data=binary)
    outputs = [
        httpclient.InferRequestedOutput("label", binary_data=binary),
        httpclient.InferRequestedOutput("probabilities", binary_data=binary),
    ]
    result = client.infer("iris", [request], outputs=outputs, request_id="req-42")
    assert result.get_response()["id"] == "req-42"
    assert result.get_response()["model_version"] == "1"
    np.testing.assert_array_equal(result.as_numpy("label"), expected_label.reshape(-1, 1))
    np.testing.assert_array_equal(result.as_numpy("probabilities"), expected_proba)


def test_requested_output_subset(client: httpclient.InferenceServerClient) -> None:
    request = httpclient.InferInput("input", [1, 4], "FP32")
    request.set_data_from_numpy(np.array([[6.7, 3.0, 5.2, 2.3]], dtype=np.float32))
    result = client.infer("iris", [request], outputs=[httpclient.InferRequestedOutput("label")])
    assert [o["name"] for o in result.get_response()["outputs"]] == ["label"]
    assert result.as_numpy("probabilities") is None
    assert result.as_numpy("label").tolist() == [[2]]


@pytest.mark.parametrize("binary", [True, False])
def test_every_datatype_round_trips(client: httpclient.InferenceServerClient, binary: bool) -> None:
    inputs, expected = [], {}
    for datatype in [*(dt for dt in ALL_DATATYPES if dt != "BF16"), "BF16"]:
        array = sample(datatype, (3, 5))
        tensor = httpclient.InferInput(f"IN_{datatype}", list(array.shape), datatype)
        # BF16 has no JSON form in tritonclient.
        as_binary = binary or datatype == "BF16"
        tensor.set_data_from_numpy(array, binary_data=as_binary)
        inputs.append(tensor)
        expected[f"OUT_{datatype}"] = array
    outputs = [
        httpclient.InferRequestedOutput(name, binary_data=binary or "BF16" in name)
        for name in expected
    ]
    result = client.infer("identity", inputs[:-1], outputs=outputs[:-1])
    bf16_result = client.infer("identity_bf16", inputs[-1:], outputs=outputs[-1:])
    for name, array in expected.items():
        got = (bf16_result if name == "OUT_BF16" else result).as_numpy(name)
        assert got is not None, name
        assert got.shape == array.shape, name
        if array.dtype == np.object_:
            as_bytes = [v.encode() if isinstance(v, str) else bytes(v) for v in got.flat]
            assert as_bytes == [bytes(v) for v in array.flat], name
        else:
            np.testing.assert_array_equal(
                got.astype(np.float64), array.astype(np.float64), err_msg=name
            )


def test_non_batching_model(client: httpclient.InferenceServerClient) -> None:
    data = np.arange(6, dtype=np.float32).reshape(2, 3)
    tensor = httpclient.InferInput("IN_FP32", [2, 3], "FP32")
    tensor.set_data_from_numpy(data)
    result = client.infer("nobatch", [tensor])
    np.testing.assert_array_equal(result.as_numpy("OUT_FP32"), data)
    assert client.get_model_metadata("nobatch")["inputs"][0]["shape"] == [2, 3]


def test_statistics_and_repository_index(client: httpclient.InferenceServerClient) -> None:
    tensor = httpclient.InferInput("input", [1, 4], "FP32")
    tensor.set_data_from_numpy(np.ones((1, 4), dtype=np.float32))
    client.infer("iris", [tensor])
    stats = client.get_inference_statistics("iris")["model_stats"][0]
    assert stats["name"] == "iris" and stats["version"] == "1"
    assert stats["inference_count"] >= 1 and stats["execution_count"] >= 1
    assert stats["inference_stats"]["success"]["count"] >= 1
    assert stats["inference_stats"]["compute_infer"]["ns"] > 0
    index = {row["name"]: row for row in client.get_model_repository_index()}
    assert index["iris"]["state"] == "READY"
    assert index["broken_config"]["state"] == "UNAVAILABLE"
    assert "max_batch_size" in index["broken_config"]["reason"]


def test_unknown_model_raises_404(client: httpclient.InferenceServerClient) -> None:
    tensor = httpclient.InferInput("input", [1, 4], "FP32")
    tensor.set_data_from_numpy(np.ones((1, 4), dtype=np.float32))
    with pytest.raises(InferenceServerException) as raised:
        client.infer("no_such_model", [tensor])
    assert raised.value.status() == "404"
    assert "no_such_model" in raised.value.message()


def test_non_utf8_bytes_into_onnxruntime_is_a_clear_400(
    client: httpclient.InferenceServerClient,
) -> None:
    inputs = []
    for datatype in (dt for dt in ALL_DATATYPES if dt != "BF16"):
        array = sample(datatype, (1, 2))
        if datatype == "BYTES":
            array = np.array([[b"\xff\xfe", b"ok"]], dtype=np.object_)
        tensor = httpclient.InferInput(f"IN_{datatype}", [1, 2], datatype)
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    with pytest.raises(InferenceServerException) as raised:
        client.infer("identity", inputs)
    assert raised.value.status() == "400"
    assert "IN_BYTES" in raised.value.message() and "UTF-8" in raised.value.message()
