"""onnxruntime backend (``platform: "onnxruntime_onnx"`` / ``backend: "onnxruntime"``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from sluice.config import ModelConfig
from sluice.errors import InvalidConfig
from workers.backends.base import Placement

_GPU_ACCELERATORS = {"tensorrt": "TensorrtExecutionProvider", "cuda": "CUDAExecutionProvider"}


def _providers(config: ModelConfig, placement: Placement) -> list[str | tuple[str, dict[str, str]]]:
    import onnxruntime as ort

    if placement.kind != "KIND_GPU":
        return ["CPUExecutionProvider"]
    available = set(ort.get_available_providers())
    wanted = [
        _GPU_ACCELERATORS[name.lower()]
        for name in config.execution_accelerators
        if name.lower() in _GPU_ACCELERATORS
    ] or ["CUDAExecutionProvider"]
    missing = [p for p in wanted if p not in available]
    if missing:
        raise InvalidConfig(
            f"model '{config.name}' asks for {', '.join(missing)} (instance kind KIND_GPU), "
            f"but this onnxruntime offers only {', '.join(sorted(available))}; "
            "install the 'gpu' extra (onnxruntime-gpu) on a machine with an NVIDIA GPU"
        )
    device = {"device_id": str(placement.gpu or 0)}
    return [(provider, device) for provider in wanted] + ["CPUExecutionProvider"]


class OnnxRuntimeBackend:
    def __init__(self, config: ModelConfig, model_path: Path, placement: Placement) -> None:
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.intra_op_num_threads = placement.threads
        options.inter_op_num_threads = 1
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        try:
            self._session = ort.InferenceSession(
                str(model_path), sess_options=options, providers=_providers(config, placement)
            )
        except InvalidConfig:
            raise
        except Exception as exc:
            raise InvalidConfig(f"onnxruntime cannot load {model_path.name}: {exc}") from None
        self._input_names = {i.name for i in self._session.get_inputs()}

    def infer(
        self, inputs: Mapping[str, np.ndarray], outputs: Sequence[str]
    ) -> dict[str, np.ndarray]:
        feed = {name: array for name, array in inputs.items() if name in self._input_names}
        results = self._session.run(list(outputs), feed)
        return dict(zip(outputs, results, strict=True))

    def close(self) -> None:
        del self._session
