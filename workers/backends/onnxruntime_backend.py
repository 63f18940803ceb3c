"""onnxruntime backend (``platform: "onnxruntime_onnx"`` / ``backend: "onnxruntime"``)."""

from __future__ import annotations

import ctypes
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from sluice.core.config import ModelConfig
from sluice.core.errors import InvalidConfig, InvalidInput, Unsupported
from sluice.core.placement import Placement
from sluice.workers.backends.threads import flag_parameter, int_parameter, threads_or_all

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


def _as_text(name: str, array: np.ndarray) -> np.ndarray:
    """onnxruntime's Python API holds string tensors as str: BYTES elements must be UTF-8."""
    text = np.empty(array.shape, dtype=np.object_)
    try:
        text.flat[:] = [v.decode() if isinstance(v, bytes) else v for v in array.flat]
    except UnicodeDecodeError:
        raise InvalidInput(
            f"input '{name}': an element is not valid UTF-8, "
            "and onnxruntime string tensors hold UTF-8 text"
        ) from None
    return text


_THREADS = range(0, 1025)
_SESSION_PREFIX = "session."
SPINNING = "session.intra_op.allow_spinning"


def session_options(config: ModelConfig, placement: Placement) -> object:
    """onnxruntime's session options from the placement and the parameters Triton's
    onnxruntime backend reads (``intra_op_thread_count``, ``inter_op_thread_count``,
    ``execution_mode``, ``enable_mem_arena``, ``enable_mem_pattern``, and any
    ``session.*`` key as a session configuration entry). Threads that wait for work do not
    spin by default (``session.intra_op.allow_spinning`` 0): every core may belong to several
    models' instances, and a spinning pool takes the cores another busy model needs."""
    import onnxruntime as ort

    name, parameters = config.name, config.parameters
    options = ort.SessionOptions()
    intra = int_parameter(name, parameters, "intra_op_thread_count", _THREADS)
    options.intra_op_num_threads = threads_or_all(placement.threads if intra is None else intra)
    inter = int_parameter(name, parameters, "inter_op_thread_count", _THREADS)
    options.inter_op_num_threads = 1 if inter is None else inter
    mode = int_parameter(name, parameters, "execution_mode", range(0, 2))
    options.execution_mode = (
        ort.ExecutionMode.ORT_PARALLEL if mode == 1 else ort.ExecutionMode.ORT_SEQUENTIAL
    )
    arena = flag_parameter(name, parameters, "enable_mem_arena")
    if arena is not None:
        options.enable_cpu_mem_arena = arena
    pattern = flag_parameter(name, parameters, "enable_mem_pattern")
    if pattern is not None:
        options.enable_mem_pattern = pattern
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.add_session_config_entry(SPINNING, "0")
    for key, value in parameters.items():
        if key.startswith(_SESSION_PREFIX):
            try:
                options.add_session_config_entry(key, value)
            except Exception as exc:
                raise InvalidConfig(f"model '{name}': parameter '{key}': {exc}") from None
    return options


class OnnxRuntimeBackend:
    computes_inline = True
    """It never calls back into the worker's event loop: a short batch may compute on the
    loop itself (:data:`sluice.workers.execution.INLINE_MAX_S`)."""

    def __init__(self, config: ModelConfig, model_path: Path, placement: Placement) -> None:
        import onnxruntime as ort

        options = session_options(config, placement)
        try:
            self._session = ort.InferenceSession(
                str(model_path), sess_options=options, providers=_providers(config, placement)
            )
        except InvalidConfig:
            raise
        except Exception as exc:
            raise InvalidConfig(f"onnxruntime cannot load {model_path.name}: {exc}") from None
        self._input_names = {i.name for i in self._session.get_inputs()}
        self._bf16 = {
            t.name
            for t in (*self._session.get_inputs(), *self._session.get_outputs())
            if t.type == "tensor(bfloat16)"
        }

    def infer(
        self,
        inputs: Mapping[str, np.ndarray],
        outputs: Sequence[str],
        request_sizes: Sequence[int] | None = None,
    ) -> dict[str, np.ndarray]:
        feed = {
            name: _as_text(name, array) if array.dtype == np.object_ else array
            for name, array in inputs.items()
            if name in self._input_names
        }
        if self._bf16:
            return self._infer_bf16(feed, outputs)
        results = self._session.run(list(outputs), feed)
        return dict(zip(outputs, results, strict=True))

    def _infer_bf16(
        self, feed: Mapping[str, np.ndarray], outputs: Sequence[str]
    ) -> dict[str, np.ndarray]:
        """numpy has no bfloat16: BF16 tensors cross as float32 arrays and OrtValues of raw bits."""
        import onnxruntime as ort
        from onnx import TensorProto

        values = {}
        for name, array in feed.items():
            if name in self._bf16:
                bits = (np.ascontiguousarray(array, dtype="<f4").view("<u4") >> 16).astype("<u2")
                values[name] = ort.OrtValue.ortvalue_from_numpy_with_onnx_type(
                    bits, onnx_element_type=TensorProto.BFLOAT16
                )
            elif array.dtype == np.object_:
                raise Unsupported(
                    "the onnxruntime backend cannot run models that mix BF16 and BYTES tensors"
                )
            else:
                values[name] = ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(array))
        results = self._session.run_with_ort_values(list(outputs), values)
        arrays: dict[str, np.ndarray] = {}
        for name, value in zip(outputs, results, strict=True):
            if name in self._bf16:
                count = int(np.prod(value.shape()))
                raw = (ctypes.c_uint16 * count).from_address(value.data_ptr())
                bits = np.frombuffer(memoryview(raw).cast("B"), dtype="<u2").astype("<u4") << 16
                arrays[name] = bits.view("<f4").reshape(value.shape())
            else:
                arrays[name] = value.numpy()
        return arrays

    def close(self) -> None:
        del self._session
