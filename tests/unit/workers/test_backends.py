"""Every backend in-process: the same answers as the model run directly, and clear errors."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest

from sluice.core.config import ModelConfig
from sluice.core.errors import (
    InferenceFailed,
    InvalidConfig,
    InvalidInput,
    SluiceError,
    Unsupported,
)
from sluice.core.placement import Placement
from sluice.core.repository import RepositoryModel, read_model
from sluice.workers.backends import load_backend
from sluice.workers.backends.base import Backend, RequestsFailed
from sluice.workers.backends.python_backend import ModelContext
from sluice.workers.warmup import warm_up
from tests.support import fake_tensorrt
from tests.support.model_files import python_config, save_exported, save_torchscript, tensor
from tests.support.model_files import write_model as write_model_dir

ROOT = Path(__file__).resolve().parents[3]
EXAMPLES = ROOT / "model_repository"
CPU = Placement("KIND_CPU", None, 1)


def _examples_builder() -> ModuleType:
    spec = importlib.util.spec_from_file_location("examples_build", EXAMPLES / "build.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _read(model_dir: Path) -> RepositoryModel:
    model = read_model(model_dir)
    assert model.error is None, model.error
    return model


def _config(model: RepositoryModel) -> ModelConfig:
    assert model.config is not None
    return model.config


@pytest.fixture
def backends() -> Iterator[list[Backend]]:
    """Backends a test loads; closed at the end."""
    loaded: list[Backend] = []
    yield loaded
    for backend in loaded:
        backend.close()


@pytest.fixture
def load(backends: list[Backend]) -> Any:
    def load(model_dir: Path, placement: Placement = CPU) -> Backend:
        model = _read(model_dir)
        backend = load_backend(_config(model), model.model_file(model.versions[-1]), placement)
        backends.append(backend)
        return backend

    return load


@pytest.fixture
def torch() -> ModuleType:
    return pytest.importorskip("torch", reason="torch is not installed (pip install sluice[torch])")


# ----------------------------------------------------------------------------- torch


def _two_io_module(torch: ModuleType) -> Any:
    class TwoIo(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            generator = torch.Generator().manual_seed(3)
            self.register_buffer("weight", torch.randn(4, 3, generator=generator))

        def forward(self, x: Any, y: Any) -> Any:
            return x @ self.weight + y, (x * 2).to(torch.int64)

    return TwoIo().eval()


TORCH_TWO_IO = """
    platform: "pytorch_libtorch"
    max_batch_size: 16
    input [ {a}, {b} ]
    output [ {c}, {d} ]
"""


def test_torchscript_orders_inputs_by_index_suffix(tmp_path: Path, torch: ModuleType, load) -> None:
    module = _two_io_module(torch)
    x, y = torch.randn(2, 4), torch.randn(2, 3)
    # Listed out of order in the config: the __<index> suffix decides the position.
    config = TORCH_TWO_IO.format(
        a=tensor("Y__1", "TYPE_FP32", "3"),
        b=tensor("X__0", "TYPE_FP32", "4"),
        c=tensor("DOUBLED__1", "TYPE_INT64", "4"),
        d=tensor("SUM__0", "TYPE_FP32", "3"),
    )
    model_dir = write_model_dir(tmp_path, "ts", config)
    save_torchscript(module, (x, y), model_dir / "1" / "model.pt")
    backend = load(model_dir)

    rng = np.random.default_rng(0)
    xs = rng.standard_normal((5, 4)).astype(np.float32)
    ys = rng.standard_normal((5, 3)).astype(np.float32)
    result = backend.infer({"Y__1": ys, "X__0": xs}, ["SUM__0", "DOUBLED__1"])
    expected_sum, expected_doubled = module(torch.from_numpy(xs), torch.from_numpy(ys))
    np.testing.assert_array_equal(result["SUM__0"], expected_sum.numpy())
    np.testing.assert_array_equal(result["DOUBLED__1"], expected_doubled.numpy())
    assert result["DOUBLED__1"].dtype == np.int64
    assert list(backend.infer({"Y__1": ys, "X__0": xs}, ["DOUBLED__1"])) == ["DOUBLED__1"]


def test_torchscript_reads_read_only_request_buffers(
    tmp_path: Path, torch: ModuleType, load
) -> None:
    module = _two_io_module(torch)
    config = TORCH_TWO_IO.format(
        a=tensor("X__0", "TYPE_FP32", "4"),
        b=tensor("Y__1", "TYPE_FP32", "3"),
        c=tensor("SUM__0", "TYPE_FP32", "3"),
        d=tensor("DOUBLED__1", "TYPE_INT64", "4"),
    )
    model_dir = write_model_dir(tmp_path, "ts", config)
    save_torchscript(module, (torch.randn(2, 4), torch.randn(2, 3)), model_dir / "1" / "model.pt")
    xs = np.frombuffer(np.arange(8, dtype=np.float32).tobytes(), dtype=np.float32).reshape(2, 4)
    ys = np.frombuffer(bytes(24), dtype=np.float32).reshape(2, 3)
    assert not xs.flags.writeable
    result = load(model_dir).infer({"X__0": xs, "Y__1": ys}, ["SUM__0"])
    np.testing.assert_allclose(result["SUM__0"], xs @ module.weight.numpy(), rtol=1e-6)


@pytest.mark.slow
def test_torch_export_orders_inputs_by_forward_names_and_reads_dict_outputs(
    tmp_path: Path, torch: ModuleType, load
) -> None:
    class DictOut(torch.nn.Module):
        def forward(self, x: Any, y: Any) -> Any:
            return {"difference": x - y, "product": x * y}

    module = DictOut().eval()
    config = """
        backend: "pytorch"
        max_batch_size: 16
        input [ { name: "y" data_type: TYPE_FP32 dims: [ 3 ] },
                { name: "x" data_type: TYPE_FP32 dims: [ 3 ] } ]
        output [ { name: "product" data_type: TYPE_FP32 dims: [ 3 ] },
                 { name: "difference" data_type: TYPE_FP32 dims: [ 3 ] } ]
    """
    model_dir = write_model_dir(tmp_path, "exported", config)
    save_exported(module, (torch.ones(2, 3), torch.ones(2, 3)), model_dir / "1" / "model.pt2")
    # Only model.pt2 is there: it stands in for the pytorch backend's default model.pt.
    assert _config(_read(model_dir)).default_model_filename == "model.pt2"
    backend = load(model_dir)

    xs = np.arange(12, dtype=np.float32).reshape(4, 3)
    ys = np.full((4, 3), 5, dtype=np.float32)
    result = backend.infer({"y": ys, "x": xs}, ["difference", "product"])
    np.testing.assert_array_equal(result["difference"], xs - ys)
    np.testing.assert_array_equal(result["product"], xs * ys)


def test_torch_bf16_inputs_and_outputs(tmp_path: Path, torch: ModuleType, load) -> None:
    class Halve(torch.nn.Module):
        def forward(self, x: Any) -> Any:
            assert x.dtype == torch.bfloat16
            return x / 2

    config = """
        platform: "pytorch_libtorch"
        max_batch_size: 4
        input [ { name: "INPUT__0" data_type: TYPE_BF16 dims: [ 2 ] } ]
        output [ { name: "OUTPUT__0" data_type: TYPE_BF16 dims: [ 2 ] } ]
    """
    model_dir = write_model_dir(tmp_path, "bf16", config)
    example = torch.ones(2, 2, dtype=torch.bfloat16)
    save_torchscript(Halve().eval(), (example,), model_dir / "1" / "model.pt")
    values = np.array([[1.5, -3.0], [256.0, 0.25]], dtype=np.float32)  # exact in bfloat16
    result = load(model_dir).infer({"INPUT__0": values}, ["OUTPUT__0"])
    assert result["OUTPUT__0"].dtype == np.float32
    np.testing.assert_array_equal(result["OUTPUT__0"], values / 2)


def test_torch_examples_equal_the_onnx_mlp(torch: ModuleType, load, tmp_path: Path) -> None:
    builder = _examples_builder()
    built = builder.build_all(tmp_path, models=["mlp", "torchscript_mlp", "torch_export_mlp"])
    assert len(built) == 3
    inputs = np.random.default_rng(1).standard_normal((7, 16)).astype(np.float32)
    onnx_out = load(tmp_path / "mlp").infer({"input": inputs}, ["output"])["output"]
    script_out = load(tmp_path / "torchscript_mlp").infer({"INPUT__0": inputs}, ["OUTPUT__0"])
    export_out = load(tmp_path / "torch_export_mlp").infer({"input": inputs}, ["output"])
    np.testing.assert_allclose(script_out["OUTPUT__0"], onnx_out, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(export_out["output"], onnx_out, rtol=1e-5, atol=1e-6)


def test_torch_model_errors_are_short_and_per_batch(
    tmp_path: Path, torch: ModuleType, load
) -> None:
    builder = _examples_builder()
    builder.build_all(tmp_path, models=["torchscript_mlp"])
    backend = load(tmp_path / "torchscript_mlp")
    with pytest.raises(InferenceFailed) as info:
        backend.infer({"INPUT__0": np.zeros((2, 5), dtype=np.float32)}, ["OUTPUT__0"])
    # The cause, not TorchScript's serialized-code traceback around it.
    assert info.value.message == (
        "RuntimeError: mat1 and mat2 shapes cannot be multiplied (2x5 and 16x32)"
    )


def test_corrupt_torch_file_is_an_invalid_config(tmp_path: Path, torch: ModuleType) -> None:
    config = """
        platform: "pytorch_libtorch"
        max_batch_size: 4
        input [ { name: "INPUT__0" data_type: TYPE_FP32 dims: [ 2 ] } ]
        output [ { name: "OUTPUT__0" data_type: TYPE_FP32 dims: [ 2 ] } ]
    """
    model_dir = write_model_dir(tmp_path, "corrupt", config, {"1/model.pt": b"not a zip"})
    model = _read(model_dir)
    with pytest.raises(InvalidConfig, match=r"^torch cannot load model\.pt: "):
        load_backend(_config(model), model.model_file(1), CPU)


def test_torch_kind_gpu_without_cuda_is_a_clear_error(tmp_path: Path, torch: ModuleType) -> None:
    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is present: the no-GPU error cannot happen here")
    model_dir = _examples_builder().build_all(tmp_path, models=["torchscript_mlp"])[0].parent.parent
    model = _read(model_dir)
    with pytest.raises(InvalidConfig) as info:
        load_backend(_config(model), model.model_file(1), Placement("KIND_GPU", 0, 1))
    message = info.value.message
    assert "model 'torchscript_mlp' asks for instance kind KIND_GPU (GPU 0)" in message
    assert "torch.cuda is not available" in message


@pytest.mark.gpu
def test_torch_on_gpu_equals_cpu(tmp_path: Path, torch: ModuleType, load) -> None:
    if not torch.cuda.is_available():
        pytest.skip(f"no CUDA GPU: torch {torch.__version__} sees none")
    _examples_builder().build_all(tmp_path, models=["torchscript_mlp", "torch_export_mlp"])
    inputs = np.random.default_rng(2).standard_normal((5, 16)).astype(np.float32)
    for name, io in (
        ("torchscript_mlp", ("INPUT__0", "OUTPUT__0")),
        ("torch_export_mlp", ("input", "output")),
    ):
        cpu = load(tmp_path / name).infer({io[0]: inputs}, [io[1]])[io[1]]
        gpu = load(tmp_path / name, Placement("KIND_GPU", 0, 1)).infer({io[0]: inputs}, [io[1]])
        np.testing.assert_allclose(gpu[io[1]], cpu, rtol=1e-4, atol=1e-5)


# ----------------------------------------------------------------------------- python


TEXT_IO = python_config(
    [tensor("TEXT", "TYPE_STRING", "1")],
    [tensor("LENGTH", "TYPE_INT64", "1"), tensor("UPPER", "TYPE_STRING", "1")],
)

SIMPLE_MODEL = """
    import numpy as np


    class Model:
        def initialize(self, config, context):
            self.config = config
            self.context = context
            self.batches = []

        def execute(self, inputs):
            text = inputs["TEXT"]
            self.batches.append(text.shape[0])
            lengths = np.array([len(t) for t in text.reshape(-1)], dtype=np.int64)
            upper = np.array([t.upper() for t in text.reshape(-1)], dtype=object)
            return {"LENGTH": lengths.reshape(text.shape), "UPPER": upper.reshape(text.shape)}

        def finalize(self):
            self.finalized = True
"""


def _texts(*values: bytes) -> np.ndarray:
    array = np.empty((len(values), 1), dtype=np.object_)
    array[:, 0] = values
    return array


def test_python_simple_model_gets_whole_batches(tmp_path: Path, load) -> None:
    model_dir = write_model_dir(tmp_path, "text", TEXT_IO, {"1/model.py": SIMPLE_MODEL})
    backend = load(model_dir)
    texts = _texts(b"abc", b"", "é".encode())
    result = backend.infer({"TEXT": texts}, ["UPPER", "LENGTH"], request_sizes=[2, 1])
    assert list(result) == ["UPPER", "LENGTH"]
    np.testing.assert_array_equal(result["LENGTH"], [[3], [0], [2]])
    assert result["UPPER"].tolist() == [[b"ABC"], [b""], ["é".encode().upper()]]

    model = backend._model
    assert model.batches == [3]
    assert model.config["name"] == "text" and model.config["max_batch_size"] == 8
    assert model.context == ModelContext("text", 1, model_dir, "KIND_CPU", 0, 1)
    backend.close()
    assert model.finalized


def test_python_model_may_be_any_single_class_with_execute(tmp_path: Path, load) -> None:
    source = """
        import numpy as np
        from helper import double  # a module next to model.py


        class Helper:
            pass


        class Doubler:
            def execute(self, inputs):
                return {"y": double(inputs["x"])}
    """
    files = {"1/model.py": source, "1/helper.py": "def double(x):\n    return x * 2\n"}
    config = python_config([tensor("x", "TYPE_INT32", "2")], [tensor("y", "TYPE_INT32", "2")])
    backend = load(write_model_dir(tmp_path, "doubler", config, files))
    result = backend.infer({"x": np.array([[1, 2]], dtype=np.int32)}, ["y"])
    np.testing.assert_array_equal(result["y"], [[2, 4]])


@pytest.mark.parametrize(
    ("source", "error", "message"),
    [
        (
            "import numpy as np\nx = 1 / 0\n",
            InvalidConfig,
            r"model\.py cannot be imported: "
            r"ZeroDivisionError: division by zero \(model\.py line 2\)",
        ),
        ("class A:\n    pass\n", InvalidConfig, r"must define class Model .*: none"),
        (
            "class Model:\n    def initialize(self, config):\n        raise KeyError('vocab')\n"
            "    def execute(self, inputs):\n        return {}\n",
            InvalidConfig,
            r"model\.py: initialize raised KeyError: 'vocab' \(model\.py line 3\)",
        ),
    ],
)
def test_python_model_load_errors(
    tmp_path: Path, source: str, error: type[SluiceError], message: str
) -> None:
    model_dir = write_model_dir(tmp_path, "bad", TEXT_IO, {"1/model.py": source})
    model = _read(model_dir)
    with pytest.raises(error, match=message):
        load_backend(_config(model), model.model_file(1), CPU)
    assert not any(name.startswith("sluice_model_bad") for name in sys.modules)


def test_python_model_execute_errors(tmp_path: Path, load) -> None:
    source = """
        from sluice.core.errors import InvalidInput


        class Model:
            def execute(self, inputs):
                text = inputs["TEXT"]
                if text[0, 0] == b"bad":
                    raise InvalidInput("no bad words")
                if text[0, 0] == b"crash":
                    raise ValueError("boom")
                if text[0, 0] == b"list":
                    return [1, 2]
                return {"LENGTH": text}
    """
    backend = load(write_model_dir(tmp_path, "erring", TEXT_IO, {"1/model.py": source}))
    with pytest.raises(InvalidInput, match="no bad words"):
        backend.infer({"TEXT": _texts(b"bad")}, ["LENGTH"])
    with pytest.raises(InferenceFailed, match=r"execute raised ValueError: boom \(model\.py line"):
        backend.infer({"TEXT": _texts(b"crash")}, ["LENGTH"])
    with pytest.raises(InferenceFailed, match="must return a dict"):
        backend.infer({"TEXT": _texts(b"list")}, ["LENGTH"])
    with pytest.raises(InferenceFailed, match=r"returned no output 'UPPER' \(it returned LENGTH"):
        backend.infer({"TEXT": _texts(b"ok")}, ["LENGTH", "UPPER"])


def test_text_stats_example(load) -> None:
    backend = load(EXAMPLES / "text_stats")
    texts = _texts(b"the quick  brown fox", "naïve café".encode(), b"", b"\xff\xfe")
    result = backend.infer({"TEXT": texts}, ["TOKENS", "CHARACTERS"])
    np.testing.assert_array_equal(result["TOKENS"], [[4], [2], [0], [1]])
    np.testing.assert_array_equal(result["CHARACTERS"], [[20], [10], [0], [2]])
    assert result["TOKENS"].dtype == np.int64


# ----------------------------------------------------------------------------- Triton Python

ADD_SUB_INPUTS = {
    "INPUT0": np.arange(12, dtype=np.float32).reshape(3, 4),
    "INPUT1": np.full((3, 4), 0.5, dtype=np.float32),
}


def test_triton_add_sub_example_splits_requests(load) -> None:
    backend = load(EXAMPLES / "triton_python_add_sub")
    for sizes in ([3], [1, 2], [1, 1, 1], None):
        result = backend.infer(ADD_SUB_INPUTS, ["OUTPUT0", "OUTPUT1"], request_sizes=sizes)
        np.testing.assert_array_equal(
            result["OUTPUT0"], ADD_SUB_INPUTS["INPUT0"] + ADD_SUB_INPUTS["INPUT1"]
        )
        np.testing.assert_array_equal(
            result["OUTPUT1"], ADD_SUB_INPUTS["INPUT0"] - ADD_SUB_INPUTS["INPUT1"]
        )


TRITON_INSPECTOR = """
    import json

    import numpy as np
    import triton_python_backend_utils as pb_utils


    class TritonPythonModel:
        def initialize(self, args):
            self.args = args
            self.seen = []

        def execute(self, requests):
            responses = []
            for request in requests:
                x = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
                self.seen.append((x.shape, request.requested_output_names()))
                if (x < 0).any():
                    error = pb_utils.TritonError("negative input", pb_utils.TritonError.INVALID_ARG)
                    responses.append(pb_utils.InferenceResponse(error=error))
                    continue
                out = pb_utils.Tensor("OUTPUT0", x * 10)
                responses.append(pb_utils.InferenceResponse([out]))
            return responses
"""

TRITON_IO = python_config(
    [tensor("INPUT0", "TYPE_FP32", "2")],
    [tensor("OUTPUT0", "TYPE_FP32", "2")],
    extra="instance_group [ { kind: KIND_CPU count: 1 } ]\n"
    'parameters { key: "k" value: { string_value: "v" } }',
)


def test_triton_model_sees_one_request_per_client_request(tmp_path: Path, load) -> None:
    model_dir = write_model_dir(tmp_path, "inspect", TRITON_IO, {"3/model.py": TRITON_INSPECTOR})
    backend = load(model_dir)
    model = backend._model
    args = model.args
    assert set(args) == {
        "model_config", "model_instance_kind", "model_instance_name",
        "model_instance_device_id", "model_repository", "model_version", "model_name",
    }  # fmt: skip
    assert args["model_name"] == "inspect" and args["model_version"] == "3"
    assert args["model_instance_kind"] == "CPU" and args["model_instance_device_id"] == "0"
    assert args["model_repository"] == str(model_dir)
    import json

    assert json.loads(args["model_config"])["parameters"] == {"k": {"string_value": "v"}}

    x = np.arange(10, dtype=np.float32).reshape(5, 2)
    result = backend.infer({"INPUT0": x}, ["OUTPUT0"], request_sizes=[2, 3])
    np.testing.assert_array_equal(result["OUTPUT0"], x * 10)
    assert model.seen == [((2, 2), ["OUTPUT0"]), ((3, 2), ["OUTPUT0"])]


def test_triton_error_response_fails_only_its_request(tmp_path: Path, load) -> None:
    model_dir = write_model_dir(tmp_path, "inspect", TRITON_IO, {"1/model.py": TRITON_INSPECTOR})
    backend = load(model_dir)
    x = np.array([[1, 2], [-1, 0], [3, 4]], dtype=np.float32)
    with pytest.raises(RequestsFailed) as info:
        backend.infer({"INPUT0": x}, ["OUTPUT0"], request_sizes=[1, 1, 1])
    failed = info.value
    assert list(failed.failures) == [1]
    assert isinstance(failed.failures[1], InvalidInput)
    assert failed.failures[1].message == "negative input"
    assert failed.outputs is not None
    np.testing.assert_array_equal(failed.outputs["OUTPUT0"], [[10, 20], [0, 0], [30, 40]])
    assert "1 request(s) of the batch failed; first: negative input" in failed.message

    with pytest.raises(RequestsFailed) as info:
        backend.infer({"INPUT0": x[1:2]}, ["OUTPUT0"], request_sizes=[1])
    assert info.value.outputs is None
    assert info.value.message == "negative input"


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("return []", r"one InferenceResponse per request \(2\), got 0"),
        ("raise pb_utils.TritonModelException('broken')", "TritonModelException: broken"),
        (
            "return [pb_utils.InferenceResponse([pb_utils.Tensor('OUTPUT0', np.zeros((1, 2)))])]"
            " * len(requests)",
            r"output 'OUTPUT0' has shape \[1, 2\] for a request of 2 batch item",
        ),
    ],
)
def test_triton_model_contract_violations(tmp_path: Path, load, body: str, message: str) -> None:
    source = (
        "import numpy as np\nimport triton_python_backend_utils as pb_utils\n\n\n"
        f"class TritonPythonModel:\n    def execute(self, requests):\n        {body}\n"
    )
    backend = load(write_model_dir(tmp_path, "bad", TRITON_IO, {"1/model.py": source}))
    with pytest.raises(InferenceFailed, match=message):
        backend.infer({"INPUT0": np.zeros((3, 2), np.float32)}, ["OUTPUT0"], request_sizes=[1, 2])


def test_pb_utils_helpers() -> None:
    from sluice.workers.backends import triton_python_backend_utils as pb_utils

    assert pb_utils.triton_string_to_numpy("TYPE_FP32") is np.float32
    assert pb_utils.triton_string_to_numpy("TYPE_STRING") is np.object_
    assert pb_utils.triton_to_numpy_type(9) is np.int64  # TYPE_INT64
    assert pb_utils.numpy_to_triton_type(np.float16) == 10  # TYPE_FP16
    config = {"input": [{"name": "a", "data_type": "TYPE_FP32"}], "output": []}
    assert pb_utils.get_input_config_by_name(config, "a") == config["input"][0]
    assert pb_utils.get_output_config_by_name(config, "a") is None
    strings = np.array([b"ab", b""], dtype=np.object_)
    encoded = pb_utils.serialize_byte_tensor(strings)
    assert pb_utils.deserialize_bytes_tensor(encoded.item()).tolist() == [b"ab", b""]
    response = pb_utils.InferenceResponse([pb_utils.Tensor("x", [1, 2])], error="oops")
    error, output = response.error(), pb_utils.get_output_tensor_by_name(response, "x")
    assert error is not None and error.message() == "oops"
    assert output is not None and output.as_numpy().tolist() == [1, 2]
    request = pb_utils.InferenceRequest("m", [], ["x"])
    with pytest.raises(pb_utils.TritonModelException, match="needs a model_name"):
        pb_utils.InferenceRequest("", [], ["x"]).exec(decoupled=True)
    with pytest.raises(pb_utils.TritonModelException, match="for decoupled models"):
        request.get_response_sender()
    sent: list[tuple[object, bool]] = []
    sender = pb_utils.InferenceResponseSender(
        lambda response, final: sent.append((response, final))
    )
    sender.send(response)
    sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
    assert sent == [(response, False), (None, True)]
    with pytest.raises(pb_utils.TritonModelException, match="Response sender has been closed"):
        sender.send(response)


# ----------------------------------------------------------------------------- TensorRT, selection


def _plan_model(root: Path, kind: str = "KIND_GPU") -> RepositoryModel:
    config = f"""
        platform: "tensorrt_plan"
        max_batch_size: 8
        input [ {{ name: "x" data_type: TYPE_FP32 dims: [ 4 ] }} ]
        output [ {{ name: "y" data_type: TYPE_FP32 dims: [ 4 ] }} ]
        instance_group [ {{ kind: {kind} gpus: [ 0 ] }} ]
    """
    return _read(write_model_dir(root, "engine", config, {"1/model.plan": b"\x00" * 16}))


def test_tensorrt_without_tensorrt_or_gpu_is_a_clear_error(tmp_path: Path) -> None:
    if importlib.util.find_spec("tensorrt") is not None:
        pytest.skip("the tensorrt package is installed: the missing-package error cannot happen")
    model = _plan_model(tmp_path)
    with pytest.raises(InvalidConfig) as info:
        load_backend(_config(model), model.model_file(1), Placement("KIND_GPU", 0, 1))
    assert info.value.message == (
        "model 'engine' needs TensorRT and an NVIDIA GPU: the 'tensorrt' package is not "
        "installed (install sluice[gpu] on a machine with an NVIDIA GPU)"
    )


def _plan_with_fake_engine(root: Path, kind: str = "KIND_GPU") -> RepositoryModel:
    config = """
        platform: "tensorrt_plan"
        max_batch_size: 8
        input [ { name: "x" data_type: TYPE_FP32 dims: [ 4 ] } ]
        output [ { name: "y" data_type: TYPE_FP32 dims: [ 4 ] } ]
    """
    if kind:
        config += f"instance_group [ {{ kind: {kind} }} ]"
    files = {"1/model.plan": fake_tensorrt.ENGINE_BYTES}
    return _read(write_model_dir(root, "engine", config, files))


def test_tensorrt_profiles_buffers_and_copies_with_a_fake_engine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, backends: list[Backend]
) -> None:
    fake_tensorrt.install(monkeypatch)
    model = _plan_with_fake_engine(tmp_path)
    backend = load_backend(_config(model), model.model_file(1), Placement("KIND_GPU", 0, 1))
    backends.append(backend)
    [engine] = fake_tensorrt.Runtime.engines
    [context] = engine.contexts
    for batch in (3, 2, 6, 1):
        x = np.random.default_rng(batch).standard_normal((batch, 4)).astype(np.float32)
        result = backend.infer({"x": x}, ["y"])
        np.testing.assert_array_equal(result["y"], 2 * x)
    assert context.runs == [(0, (3, 4)), (0, (2, 4)), (1, (6, 4)), (0, (1, 4))]
    with pytest.raises(InvalidInput, match=r"fit no optimization profile .*x \[5, 4\]\.\.\[8, 4\]"):
        backend.infer({"x": np.zeros((9, 4), np.float32)}, ["y"])


def test_tensorrt_without_a_default_instance_group_uses_gpu_0(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, backends: list[Backend]
) -> None:
    fake_tensorrt.install(monkeypatch)
    model = _plan_with_fake_engine(tmp_path, kind="")
    backends.append(load_backend(_config(model), model.model_file(1), CPU))


@pytest.mark.parametrize(
    ("setup", "message"),
    [
        ({"cuda": False}, "the 'cuda-python' package is not installed"),
        (
            {"devices": 0},
            "no usable NVIDIA GPU (CUDA cudaGetDeviceCount failed: cudaErrorNoDevice)",
        ),
        ({"kind": "KIND_CPU"}, "TensorRT engines run on GPUs only"),
        ({"gpu": 3}, "asks for GPU 3, but only 1 GPU(s) are visible"),
        ({"plan": b"garbage"}, "TensorRT cannot deserialize model.plan"),
    ],
)
def test_tensorrt_errors_with_a_fake_engine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, setup: dict[str, Any], message: str
) -> None:
    fake_tensorrt.install(
        monkeypatch, cuda=setup.get("cuda", True), devices=setup.get("devices", 1)
    )
    model = _plan_with_fake_engine(tmp_path, kind=setup.get("kind", "KIND_GPU"))
    if "plan" in setup:
        (tmp_path / "engine" / "1" / "model.plan").write_bytes(setup["plan"])
    placement = Placement(setup.get("kind", "KIND_GPU"), setup.get("gpu", 0), 1)
    with pytest.raises(InvalidConfig) as info:
        load_backend(_config(model), model.model_file(1), placement)
    assert message in info.value.message


def test_unknown_backend_is_unsupported(tmp_path: Path) -> None:
    config = 'backend: "dali"\nmax_batch_size: 0\ndefault_model_filename: "model.dali"\n'
    config += (
        f"input [ {tensor('x', 'TYPE_FP32', '1')} ]\noutput [ {tensor('y', 'TYPE_FP32', '1')} ]"
    )
    model_dir = write_model_dir(tmp_path, "pipeline", config, {"1/model.dali": "x"})
    model = read_model(model_dir)
    assert model.config is not None
    with pytest.raises(Unsupported, match="backend 'dali' is not supported"):
        load_backend(model.config, model_dir / "1" / "model.dali", CPU)


def test_python_backend_is_inferred_from_model_py(tmp_path: Path) -> None:
    config = "max_batch_size: 2\n" + (
        f"input [ {tensor('x', 'TYPE_FP32', '1')} ]\noutput [ {tensor('y', 'TYPE_FP32', '1')} ]"
    )
    model_dir = write_model_dir(tmp_path, "plain", config, {"1/model.py": SIMPLE_MODEL})
    config_read = _config(_read(model_dir))
    assert (config_read.backend, config_read.default_model_filename) == ("python", "model.py")


# ----------------------------------------------------------------------------- warm-up


WARMUP_RECORDER = """
    import numpy as np


    class Model:
        calls = []

        def execute(self, inputs):
            Model.calls.append({name: array.copy() for name, array in inputs.items()})
            if "FAIL" in inputs:
                raise RuntimeError("cold engine")
            n = next(iter(inputs.values())).shape[0]
            return {"y": np.zeros((n, 1), dtype=np.float32)}
"""


def _warmup_model(root: Path, warmup: str, files: dict[str, str | bytes] | None = None) -> Path:
    inputs = [
        tensor("x", "TYPE_FP32", "2"),
        '{ name: "s" data_type: TYPE_STRING dims: [ -1 ] optional: true }',
        '{ name: "FAIL" data_type: TYPE_BOOL dims: [ 1 ] optional: true }',
    ]
    config = python_config(inputs, [tensor("y", "TYPE_FP32", "1")], extra=warmup)
    return write_model_dir(root, "warm", config, {"1/model.py": WARMUP_RECORDER, **(files or {})})


def _warm(backend: Backend, model_dir: Path) -> list[dict[str, np.ndarray]]:
    calls: list[dict[str, np.ndarray]] = backend._model.calls  # type: ignore[attr-defined]
    calls.clear()
    warm_up(backend, _config(_read(model_dir)), model_dir)
    return calls


def test_warmup_zero_random_and_file_data(tmp_path: Path, load) -> None:
    warmup = """
    model_warmup [
      { name: "zeros" batch_size: 3 count: 2
        inputs { key: "x" value: { data_type: TYPE_FP32 dims: [ 2 ] zero_data: true } }
        inputs { key: "s" value: { data_type: TYPE_STRING dims: [ 2 ] zero_data: true } } },
      { name: "random" batch_size: 2
        inputs { key: "x" value: { data_type: TYPE_FP32 dims: [ 2 ] random_data: true } }
        inputs { key: "s" value: { data_type: TYPE_STRING dims: [ 1 ] random_data: true } } },
      { name: "skipped" batch_size: 0
        inputs { key: "x" value: { data_type: TYPE_FP32 dims: [ 2 ] zero_data: true } } },
      { name: "file" batch_size: 2
        inputs { key: "x" value: { data_type: TYPE_FP32 dims: [ 2 ] input_data_file: "x.bin" } }
        inputs { key: "s" value: { data_type: TYPE_STRING dims: [ 2 ] input_data_file: "s.bin" } } }
    ]
    """
    files: dict[str, str | bytes] = {
        "warmup/x.bin": np.array([1.5, -2], dtype="<f4").tobytes(),  # one item, repeated
        "warmup/s.bin": b"".join(len(v).to_bytes(4, "little") + v for v in [b"a", b"bc"] * 2),
    }
    model_dir = _warmup_model(tmp_path, warmup, files)
    calls = _warm(load(model_dir), model_dir)
    assert len(calls) == 4  # zeros twice, random once, file once; batch 0 skipped
    zeros, _, random, from_file = calls
    np.testing.assert_array_equal(zeros["x"], np.zeros((3, 2), np.float32))
    assert zeros["s"].shape == (3, 2) and set(zeros["s"].flat) == {b""}
    assert random["x"].shape == (2, 2) and random["x"].dtype == np.float32
    assert random["x"].std() > 0
    assert random["s"].shape == (2, 1) and all(len(v) == 8 for v in random["s"].flat)
    np.testing.assert_array_equal(from_file["x"], [[1.5, -2], [1.5, -2]])
    assert from_file["s"].tolist() == [[b"a", b"bc"], [b"a", b"bc"]]
    assert calls[0]["x"].shape == (3, 2)


@pytest.mark.parametrize(
    ("warmup", "message"),
    [
        (
            'model_warmup [ { name: "boom" batch_size: 1 inputs { key: "x" value: '
            '{ data_type: TYPE_FP32 dims: [ 2 ] zero_data: true } } inputs { key: "FAIL" value: '
            "{ data_type: TYPE_BOOL dims: [ 1 ] random_data: true } } count: 3 } ]",
            r"^warm-up 'boom' failed: execute raised RuntimeError: cold engine \(model\.py line",
        ),
        (
            'model_warmup [ { name: "nofile" batch_size: 1 inputs { key: "x" value: '
            '{ data_type: TYPE_FP32 dims: [ 2 ] input_data_file: "missing.bin" } } } ]',
            r"^warm-up 'nofile' failed: input 'x': warmup/missing\.bin does not exist$",
        ),
        (
            'model_warmup [ { name: "short" batch_size: 2 inputs { key: "x" value: '
            '{ data_type: TYPE_FP32 dims: [ 2 ] input_data_file: "short.bin" } } } ]',
            r"^warm-up 'short' failed: input 'x': warmup/short\.bin holds 3 FP32 element\(s\) "
            r"\(12 bytes\); expected 2 \(dims \[2\]\) or 4 \(the whole batch\)$",
        ),
        (
            'model_warmup [ { name: "wrongdims" batch_size: 1 inputs { key: "x" value: '
            "{ data_type: TYPE_FP32 dims: [ 3 ] zero_data: true } } } ]",
            r"^warm-up 'wrongdims' failed: input 'x': sample dims \[3\] do not fit the "
            r"model's dims \[2\]$",
        ),
        (
            'model_warmup [ { name: "typo" batch_size: 1 inputs { key: "X" value: '
            "{ data_type: TYPE_FP32 dims: [ 2 ] zero_data: true } } } ]",
            r"^warm-up 'typo' failed: 'X' is not an input of the model$",
        ),
    ],
)
def test_warmup_failures_name_the_sample(tmp_path: Path, load, warmup: str, message: str) -> None:
    model_dir = _warmup_model(tmp_path, warmup, {"warmup/short.bin": bytes(12)})
    backend = load(model_dir)
    with pytest.raises(InvalidConfig, match=message):
        _warm(backend, model_dir)


def test_warmup_fails_fast_on_the_first_error(tmp_path: Path, load) -> None:
    warmup = (
        'model_warmup [ { name: "boom" batch_size: 2 count: 5 inputs { key: "x" value: '
        '{ data_type: TYPE_FP32 dims: [ 2 ] zero_data: true } } inputs { key: "FAIL" value: '
        "{ data_type: TYPE_BOOL dims: [ 1 ] random_data: true } } } ]"
    )
    model_dir = _warmup_model(tmp_path, warmup)
    backend = load(model_dir)
    with pytest.raises(InvalidConfig):
        _warm(backend, model_dir)
    assert len(backend._model.calls) == 1


@pytest.mark.parametrize(
    ("warmup", "message"),
    [
        ("model_warmup [ { batch_size: 1 } ]", "model_warmup #0: name must not be empty"),
        (
            'model_warmup [ { name: "big" batch_size: 9 inputs { key: "x" value: '
            "{ data_type: TYPE_FP32 dims: [ 2 ] zero_data: true } } } ]",
            "model_warmup 'big': batch_size 9 exceeds max_batch_size 8",
        ),
        (
            'model_warmup [ { name: "nodata" batch_size: 1 inputs { key: "x" value: '
            "{ data_type: TYPE_FP32 dims: [ 2 ] } } } ]",
            "input 'x': set one of zero_data, random_data or input_data_file",
        ),
        (
            'model_warmup [ { name: "var" batch_size: 1 inputs { key: "x" value: '
            "{ data_type: TYPE_FP32 dims: [ -1 ] zero_data: true } } } ]",
            "input 'x': dims [-1]: warm-up dimensions must be fixed sizes >= 1",
        ),
        (
            'model_warmup [ { name: "escape" batch_size: 1 inputs { key: "x" value: '
            '{ data_type: TYPE_FP32 dims: [ 2 ] input_data_file: "../../etc/passwd" } } } ]',
            "input_data_file '../../etc/passwd' must be a file name inside the model's warmup/",
        ),
    ],
)
def test_invalid_warmup_config_makes_the_model_unavailable(
    tmp_path: Path, warmup: str, message: str
) -> None:
    model = read_model(_warmup_model(tmp_path, warmup))
    assert model.error is not None
    assert message in model.error


def test_warmup_parses_into_the_config(tmp_path: Path) -> None:
    warmup = (
        'model_warmup [ { name: "w" batch_size: 4 inputs { key: "x" value: '
        "{ data_type: TYPE_FP32 dims: [ 2 ] random_data: true } } } ]"
    )
    config = _config(_read(_warmup_model(tmp_path, warmup)))
    [sample] = config.warmup
    assert (sample.name, sample.batch_size, sample.count) == ("w", 4, 1)
    [item] = sample.inputs
    assert (item.name, item.datatype, item.dims, item.source) == ("x", "FP32", (2,), "random")
