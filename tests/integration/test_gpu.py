"""What needs an NVIDIA GPU, on one: torch models on ``KIND_GPU`` instances served end to
end, Triton's GPU gauges read through NVML while they run, and CUDA shared-memory regions
opened from another process's IPC handle.

Every test is marked ``gpu``. Without a CUDA device (the machines CI runs on) each one skips
and says why; ``pytest -m gpu`` on a GPU host runs them.
"""

from __future__ import annotations

import base64
import re
import subprocess
import sys
import textwrap
import warnings
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from sluice.gateway.metrics.gpu import GPU_FAMILIES, GpuUsage
from sluice.gateway.torchserve.system import SystemGauges
from sluice.scheduler.executor.redis_server import RedisServer
from tests.integration.conftest import load_examples_builder
from tests.support.stack import Stack

pytestmark = pytest.mark.gpu

TORCH_MODELS = {
    "torchscript_mlp": ("INPUT__0", "OUTPUT__0"),
    "torch_export_mlp": ("input", "output"),
}


def _need_cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip(f"no CUDA GPU: torch {torch.__version__} sees none")


def _on_gpu(config: str) -> str:
    """The example's config with its instance group on GPU 0."""
    placed, count = re.subn(r"kind:\s*KIND_CPU", "kind: KIND_GPU\n    gpus: [ 0 ]", config)
    assert count == 1, "the example config has one KIND_CPU instance group"
    return placed


@pytest.fixture(scope="module")
def gpu_stack(
    tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer
) -> Iterator[Stack]:
    _need_cuda()
    root = tmp_path_factory.mktemp("gpu_repository")
    load_examples_builder().build_all(root, models=(*TORCH_MODELS, "mlp"))
    for name in TORCH_MODELS:
        config = root / name / "config.pbtxt"
        config.write_text(_on_gpu(config.read_text()))
    stack = Stack(root, redis_server.url)
    stack.start(timeout_s=180)
    stack.root = root  # type: ignore[attr-defined]
    yield stack
    stack.stop()


def _infer(http: httpx.Client, model: str, name: str, rows: np.ndarray) -> np.ndarray:
    body = {
        "inputs": [
            {
                "name": name,
                "shape": list(rows.shape),
                "datatype": "FP32",
                "data": rows.ravel().tolist(),
            }
        ]
    }
    response = http.post(f"/v2/models/{model}/infer", json=body)
    assert response.status_code == 200, response.text
    output = response.json()["outputs"][0]
    return np.asarray(output["data"], np.float32).reshape(output["shape"])


def test_torch_models_on_a_gpu_answer_as_on_the_cpu(gpu_stack: Stack) -> None:
    rows = np.random.default_rng(3).standard_normal((6, 16)).astype(np.float32)
    root: Path = gpu_stack.root  # type: ignore[attr-defined]
    with httpx.Client(base_url=gpu_stack.url, timeout=60) as http:
        for model, (input_name, _) in TORCH_MODELS.items():
            config = http.get(f"/v2/models/{model}/config").json()
            assert config["instance_group"][0]["kind"] == "KIND_GPU"
            served = _infer(http, model, input_name, rows)
            # The same file, in this process, on the CPU.
            version = root / model / "1"
            with warnings.catch_warnings():  # TorchScript's deprecation; read-only buffers
                warnings.simplefilter("ignore")
                if model == "torchscript_mlp":
                    module = torch.jit.load(str(version / "model.pt"), map_location="cpu")
                else:
                    module = torch.export.load(str(version / "model.pt2")).module()
            with torch.no_grad():
                expected = module(torch.from_numpy(rows)).numpy()
            np.testing.assert_allclose(served, expected, rtol=1e-4, atol=1e-5)
        # The ONNX model beside them stays on the CPU and answers as well.
        assert _infer(http, "mlp", "input", rows).shape == (6, 4)


def test_gpu_gauges_are_tritons_and_read_the_real_device(gpu_stack: Stack) -> None:
    pynvml = pytest.importorskip("pynvml", reason="the nvidia-ml-py package (gpu extra)")
    pynvml.nvmlInit()
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        uuid = pynvml.nvmlDeviceGetUUID(handle)
        uuid = uuid.decode() if isinstance(uuid, bytes) else str(uuid)
        total = pynvml.nvmlDeviceGetMemoryInfo(handle).total
    finally:
        pynvml.nvmlShutdown()
    text = httpx.get(f"{gpu_stack.url}/metrics", timeout=30).text
    values = {
        match[1]: float(match[2])
        for match in re.finditer(rf'^(nv_\w+)\{{gpu_uuid="{re.escape(uuid)}"\}} (\S+)$', text, re.M)
    }
    assert set(values) >= set(GPU_FAMILIES), text
    assert values["nv_gpu_memory_total_bytes"] == total
    assert 0 < values["nv_gpu_memory_used_bytes"] <= total  # the workers' models are there
    assert 0 <= values["nv_gpu_utilization"] <= 1
    assert values["nv_gpu_power_limit"] > 0


def test_torchserve_gpu_gauges_read_the_real_device() -> None:
    _need_cuda()
    pynvml = pytest.importorskip("pynvml", reason="the nvidia-ml-py package (gpu extra)")
    readings = SystemGauges(gpus=GpuUsage()).gpu_readings()
    pynvml.nvmlInit()
    try:
        count = pynvml.nvmlDeviceGetCount()
        total = pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).total
    finally:
        pynvml.nvmlShutdown()
    assert set(readings) == {"GPUUtilization", "GPUMemoryUsed", "GPUMemoryUtilization"}
    used, unit = readings["GPUMemoryUsed"]
    assert unit == "MB" and [device for device, _ in used] == list(range(count))
    assert 0 < used[0][1] <= total / 2**20
    for name in ("GPUUtilization", "GPUMemoryUtilization"):
        assert all(0 <= value <= 100 for _, value in readings[name][0])


_HOLDER = textwrap.dedent(
    """
    import base64, ctypes, sys
    import numpy as np
    from cuda.bindings import runtime as rt

    rt.cudaSetDevice(0)
    err, pointer = rt.cudaMalloc(64)
    assert err == rt.cudaError_t.cudaSuccess, err
    data = np.arange(16, dtype=np.float32)
    rt.cudaMemcpy(pointer, data.ctypes.data, 64, rt.cudaMemcpyKind.cudaMemcpyHostToDevice)
    err, handle = rt.cudaIpcGetMemHandle(pointer)
    assert err == rt.cudaError_t.cudaSuccess, err
    print(base64.b64encode(ctypes.string_at(handle.getPtr(), 64)).decode(), flush=True)
    sys.stdin.read()  # hold the memory until the test is done
    """
)


@pytest.fixture
def ipc_handle() -> Iterator[str]:
    """The base64 CUDA IPC handle of 64 bytes of GPU memory that another process holds."""
    _need_cuda()
    pytest.importorskip("cuda.bindings.runtime", reason="the cuda-python package (gpu extra)")
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None
        line = holder.stdout.readline().strip()
        assert line, f"the holder process wrote no handle (exit {holder.poll()})"
        yield line
    finally:
        holder.kill()
        holder.wait(timeout=30)
        for pipe in (holder.stdin, holder.stdout):
            if pipe is not None:
                pipe.close()


def test_cuda_regions_register_from_another_process(gpu_stack: Stack, ipc_handle: str) -> None:
    region = "/v2/cudasharedmemory/region"
    with httpx.Client(base_url=gpu_stack.url, timeout=30) as http:
        registered = http.post(
            f"{region}/gpu_in/register",
            json={"raw_handle": {"b64": ipc_handle}, "device_id": 0, "byte_size": 64},
        )
        assert registered.status_code == 200, registered.text
        status = http.get(f"{region}/gpu_in/status").json()
        assert status == [{"name": "gpu_in", "device_id": 0, "byte_size": 64}]

        forged = base64.b64encode(bytes(range(64))).decode()
        refused = http.post(
            f"{region}/forged/register",
            json={"raw_handle": {"b64": forged}, "device_id": 0, "byte_size": 64},
        )
        assert refused.status_code == 400
        assert refused.json()["error"].startswith(
            "failed to register shared memory region: invalid args: opening the CUDA IPC "
            "handle of region 'forged' failed"
        )
        absent = http.post(
            f"{region}/far/register",
            json={"raw_handle": {"b64": ipc_handle}, "device_id": 64, "byte_size": 64},
        )
        assert absent.status_code == 400 and "device_id 64 does not exist" in absent.text

        assert http.post(f"{region}/gpu_in/unregister").status_code == 200
        assert http.get("/v2/cudasharedmemory/status").json() == []


def test_onnx_models_on_a_gpu_use_cudas_provider(
    tmp_path: Path, start_stack, gpu_stack: Stack
) -> None:
    import onnxruntime

    if "CUDAExecutionProvider" not in onnxruntime.get_available_providers():
        pytest.skip(
            f"onnxruntime {onnxruntime.__version__} here has no CUDA provider "
            "(the gpu extra installs onnxruntime-gpu)"
        )
    load_examples_builder().build_all(tmp_path, models=("mlp",))
    config = tmp_path / "mlp" / "config.pbtxt"
    config.write_text(_on_gpu(config.read_text()))
    stack = start_stack(tmp_path)
    rows = np.random.default_rng(4).standard_normal((3, 16)).astype(np.float32)
    with (
        httpx.Client(base_url=stack.url, timeout=60) as gpu,
        httpx.Client(base_url=gpu_stack.url, timeout=60) as cpu,
    ):
        np.testing.assert_allclose(
            _infer(gpu, "mlp", "input", rows),
            _infer(cpu, "mlp", "input", rows),
            rtol=1e-4,
            atol=1e-5,
        )
