"""TensorFlow (``platform: "tensorflow_savedmodel"`` with a ``model.savedmodel`` folder, or
``"tensorflow_graphdef"`` with a frozen ``model.graphdef``), run by TensorFlow itself, which
the ``tensorflow`` extra installs and only such a model's worker imports.

As in Triton's TensorFlow backend, a SavedModel's tensors are its signature's input and
output keys (the ``serving_default`` signature, or the one named by the
``TF_SIGNATURE_DEF`` parameter), and a GraphDef's are its nodes' names (``name`` stands for
the tensor ``name:0``). The instance's share of the cores sets TensorFlow's intra-op
threads; a KIND_GPU instance runs on its GPU when TensorFlow sees one (a CUDA build of
TensorFlow), and fails to load with the reason otherwise.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, cast

import numpy as np

from sluice.core.config import ModelConfig
from sluice.core.errors import InvalidConfig, Unsupported
from sluice.core.placement import Placement
from sluice.workers.backends.base import missing_extra
from sluice.workers.backends.threads import threads_or_all

SAVEDMODEL = "tensorflow_savedmodel"
GRAPHDEF = "tensorflow_graphdef"
SIGNATURE_PARAMETER = "TF_SIGNATURE_DEF"

Run = Callable[[dict[str, Any]], Mapping[str, Any]]


def _device(tf: Any, config: ModelConfig, placement: Placement) -> str:
    if placement.kind != "KIND_GPU":
        return "/CPU:0"
    gpus = tf.config.list_physical_devices("GPU")
    if not gpus:
        raise Unsupported(
            f"model '{config.name}' asks for a GPU (KIND_GPU), but TensorFlow sees none: "
            "a CUDA build of TensorFlow on a machine with an NVIDIA GPU is needed"
        )
    return f"/GPU:{placement.gpu or 0}"


def _check_names(config: ModelConfig, kind: str, declared: list[str], found: set[str]) -> None:
    missing = [name for name in declared if name not in found]
    if missing:
        raise InvalidConfig(
            f"model '{config.name}': the model has no {kind} named "
            f"{', '.join(repr(m) for m in missing)} (it has {sorted(found)})"
        )


def _saved_model(tf: Any, config: ModelConfig, path: Path) -> tuple[Run, Any]:
    try:
        loaded = tf.saved_model.load(str(path))
    except Exception as exc:
        raise InvalidConfig(f"TensorFlow cannot load {path.name}: {exc}") from None
    name = config.parameters.get(SIGNATURE_PARAMETER, "serving_default")
    signatures = dict(loaded.signatures)
    if name not in signatures:
        raise InvalidConfig(
            f"model '{config.name}': the SavedModel has no signature '{name}' (it has "
            f"{sorted(signatures)}; parameter {SIGNATURE_PARAMETER} picks one)"
        )
    signature = signatures[name]
    inputs = set(signature.structured_input_signature[1])
    outputs = set(signature.structured_outputs)
    _check_names(config, "input", [t.name for t in config.inputs], inputs)
    _check_names(config, "output", [t.name for t in config.outputs], outputs)

    def run(feed: dict[str, Any]) -> Mapping[str, Any]:
        return cast(Mapping[str, Any], signature(**feed))

    return run, loaded


def _graph_def(tf: Any, config: ModelConfig, path: Path) -> tuple[Run, Any]:
    graph_def = tf.compat.v1.GraphDef()
    try:
        graph_def.ParseFromString(path.read_bytes())
    except Exception as exc:
        raise InvalidConfig(f"{path.name} is not a TensorFlow GraphDef: {exc}") from None

    def imported() -> None:
        tf.compat.v1.import_graph_def(graph_def, name="")

    wrapped = tf.compat.v1.wrap_function(imported, [])
    nodes = {node.name for node in graph_def.node}
    input_names = [t.name for t in config.inputs]
    output_names = [t.name for t in config.outputs]
    _check_names(config, "input node", input_names, nodes)
    _check_names(config, "output node", output_names, nodes)
    graph = wrapped.graph
    pruned = wrapped.prune(
        [graph.get_tensor_by_name(f"{name}:0") for name in input_names],
        [graph.get_tensor_by_name(f"{name}:0") for name in output_names],
    )

    def run(feed: dict[str, Any]) -> Mapping[str, Any]:
        results = pruned(*(feed[name] for name in input_names))
        return dict(zip(output_names, results, strict=True))

    return run, wrapped


class TensorFlowBackend:
    def __init__(self, config: ModelConfig, model_path: Path, placement: Placement) -> None:
        try:
            import tensorflow as tf
        except ImportError:
            raise missing_extra(config.name, "TensorFlow", "tensorflow") from None
        self._tf = tf
        with contextlib.suppress(RuntimeError):  # only before TensorFlow's first op
            tf.config.threading.set_intra_op_parallelism_threads(threads_or_all(placement.threads))
            tf.config.threading.set_inter_op_parallelism_threads(1)
        self._device = _device(tf, config, placement)
        self._inputs = {t.name for t in config.inputs}
        with tf.device(self._device):
            if config.platform == SAVEDMODEL or (
                config.platform != GRAPHDEF and model_path.is_dir()
            ):
                self._run, self._keep = _saved_model(tf, config, model_path)
            else:
                self._run, self._keep = _graph_def(tf, config, model_path)

    def infer(
        self,
        inputs: Mapping[str, np.ndarray],
        outputs: Sequence[str],
        request_sizes: Sequence[int] | None = None,
    ) -> dict[str, np.ndarray]:
        tf = self._tf
        with tf.device(self._device):
            feed = {
                name: tf.constant(array) for name, array in inputs.items() if name in self._inputs
            }
            results = self._run(feed)
        return {name: np.asarray(results[name].numpy()) for name in outputs}

    def close(self) -> None:
        self._keep = None
