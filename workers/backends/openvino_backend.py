"""OpenVINO (``backend: "openvino"``): OpenVINO IR (``model.xml`` with its ``model.bin``)
or an ONNX file (``default_model_filename: "model.onnx"``), compiled for the CPU by the
OpenVINO runtime, often the fastest CPU path for convolutional networks.

As Triton's OpenVINO backend, upper-case ``parameters`` are OpenVINO properties handed to
``compile_model`` (``PERFORMANCE_HINT``, ``INFERENCE_NUM_THREADS``, ``NUM_STREAMS``,
``INFERENCE_PRECISION_HINT``, ...); a property OpenVINO does not know makes the model
unavailable with its name. By default the model compiles for latency (one stream: Sluice
forms the batches) on the instance's share of the cores, in FP32 (OpenVINO would pick bf16
on CPUs that have it; ``INFERENCE_PRECISION_HINT: "bf16"`` asks for that). With
``max_batch_size`` above 0 a model whose first dimension is fixed is reshaped to a dynamic
batch, unless
``SKIP_OV_DYNAMIC_BATCHSIZE`` is ``YES``; ``RESHAPE_IO_LAYERS: "YES"`` makes every
dimension the config declares -1 dynamic too.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from sluice.core.config import ModelConfig
from sluice.core.errors import InvalidConfig, Unsupported
from sluice.core.placement import Placement
from sluice.workers.backends.base import missing_extra
from sluice.workers.backends.threads import threads_or_all

_SLUICE_KEYS = {"SKIP_OV_DYNAMIC_BATCHSIZE", "RESHAPE_IO_LAYERS"}
"""Triton's OpenVINO backend options that are not OpenVINO properties."""


def _yes(config: ModelConfig, key: str) -> bool:
    raw = config.parameters.get(key, "NO").strip().upper()
    if raw not in ("YES", "NO"):
        raise InvalidConfig(f"model '{config.name}': parameter '{key}' must be YES or NO")
    return raw == "YES"


def compile_properties(config: ModelConfig, placement: Placement) -> dict[str, str]:
    """The properties ``compile_model`` gets: the config's upper-case parameters over
    Sluice's defaults."""
    properties = {
        "PERFORMANCE_HINT": "LATENCY",
        # OpenVINO computes in bf16 on CPUs that have it unless told otherwise: an FP32
        # model answers as FP32 here, as with every other backend (opt in with "bf16").
        "INFERENCE_PRECISION_HINT": "f32",
        "INFERENCE_NUM_THREADS": str(threads_or_all(placement.threads)),
    }
    for key, value in config.parameters.items():
        if key.isupper() and key not in _SLUICE_KEYS:
            properties[key] = value
    return properties


def _reshape(model: Any, config: ModelConfig) -> None:
    """A dynamic first dimension for batching models (and, with RESHAPE_IO_LAYERS, every
    dimension the config declares -1)."""
    import openvino as ov

    reshape_all = _yes(config, "RESHAPE_IO_LAYERS")
    if config.max_batch_size <= 0 and not reshape_all:
        return
    if config.max_batch_size > 0 and _yes(config, "SKIP_OV_DYNAMIC_BATCHSIZE") and not reshape_all:
        return
    declared = {spec.name: spec.dims for spec in config.inputs}
    shapes = {}
    for port in model.inputs:
        shape = port.get_partial_shape()
        dims = [shape[i] for i in range(shape.rank.get_length())]
        names = port.get_names()
        spec = next((declared[n] for n in names if n in declared), None)
        if config.max_batch_size > 0 and dims:
            dims[0] = ov.Dimension(-1)
        if reshape_all and spec is not None:
            offset = 1 if config.max_batch_size > 0 else 0
            for index, dim in enumerate(spec):
                if dim == -1 and index + offset < len(dims):
                    dims[index + offset] = ov.Dimension(-1)
        shapes[port] = ov.PartialShape(dims)
    model.reshape(shapes)


class OpenVinoBackend:
    computes_inline = True
    """It never calls back into the worker's event loop: a short batch may compute on the
    loop itself (:data:`sluice.workers.execution.INLINE_MAX_S`)."""

    def __init__(self, config: ModelConfig, model_path: Path, placement: Placement) -> None:
        if placement.kind == "KIND_GPU":
            raise Unsupported(
                f"model '{config.name}': the OpenVINO backend runs on the CPU here; use "
                "instance_group kind KIND_CPU"
            )
        if any(t.datatype == "BYTES" for t in (*config.inputs, *config.outputs)):
            raise Unsupported(f"model '{config.name}': OpenVINO models take no BYTES tensors")
        try:
            import openvino as ov
        except ImportError:
            raise missing_extra(config.name, "OpenVINO", "openvino") from None
        core = ov.Core()
        properties = compile_properties(config, placement)
        try:
            model = core.read_model(str(model_path))
            _reshape(model, config)
        except InvalidConfig:
            raise
        except Exception as exc:
            raise InvalidConfig(f"OpenVINO cannot read {model_path.name}: {exc}") from None
        try:
            self._compiled = core.compile_model(model, "CPU", properties)
        except Exception as exc:
            raise InvalidConfig(
                f"model '{config.name}': OpenVINO cannot compile it with properties "
                f"{properties}: {exc}"
            ) from None
        self._request = self._compiled.create_infer_request()
        self._inputs = {name: port for port in self._compiled.inputs for name in port.get_names()}
        self._outputs = {name: port for port in self._compiled.outputs for name in port.get_names()}
        missing = [t.name for t in config.inputs if t.name not in self._inputs]
        missing += [t.name for t in config.outputs if t.name not in self._outputs]
        if missing:
            raise InvalidConfig(
                f"model '{config.name}': {model_path.name} has no tensor named "
                f"{', '.join(repr(m) for m in missing)} (it has inputs "
                f"{sorted(self._inputs)} and outputs {sorted(self._outputs)})"
            )

    def infer(
        self,
        inputs: Mapping[str, np.ndarray],
        outputs: Sequence[str],
        request_sizes: Sequence[int] | None = None,
    ) -> dict[str, np.ndarray]:
        feed = {
            self._inputs[name]: np.ascontiguousarray(array)
            for name, array in inputs.items()
            if name in self._inputs
        }
        results = self._request.infer(feed)
        return {name: np.array(results[self._outputs[name]]) for name in outputs}

    def close(self) -> None:
        del self._request
        del self._compiled
