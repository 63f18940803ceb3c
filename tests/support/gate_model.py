"""A model that holds a request for as long as the test wants, asleep: a Triton Python model
with the slow model's interface (``IN`` FP32 [-1, 4], ``ITERS`` INT64 [-1, 1] -> ``OUT``
equal to ``IN``, so :func:`tests.support.load.slow_request` builds its requests).

A request whose ``ITERS`` reach :data:`BLOCKER_ITERS` waits until the file named like the
model appears in the folder ``SLUICE_TEST_GATE`` of the stack's environment (the test's
:func:`open_gate`), or five minutes pass; any other request is answered at once. Unlike the
slow ONNX model's long requests, a held request costs no CPU, and it ends when the test has
checked what it needed, not after a time guessed to be long enough on a busy machine.
"""

from __future__ import annotations

from pathlib import Path

BLOCKER_ITERS = 1_000_000

_MODEL = """
import os
import time

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.gate = os.path.join(os.environ["SLUICE_TEST_GATE"], args["model_name"])

    def execute(self, requests):
        responses = []
        for request in requests:
            iters = pb_utils.get_input_tensor_by_name(request, "ITERS").as_numpy()
            if int(iters.max()) >= BLOCKER_ITERS:
                deadline = time.monotonic() + 300
                while not os.path.exists(self.gate) and time.monotonic() < deadline:
                    time.sleep(0.01)
            x = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", x)]))
        return responses
"""

_CONFIG = """name: "{name}"
backend: "python"
max_batch_size: {max_batch_size}
input [ {{ name: "IN" data_type: TYPE_FP32 dims: [ 4 ] }},
        {{ name: "ITERS" data_type: TYPE_INT64 dims: [ 1 ] }} ]
output [ {{ name: "OUT" data_type: TYPE_FP32 dims: [ 4 ] }} ]
instance_group [ {{ count: 1 kind: KIND_CPU {instance_extra} }} ]
"""


def write_gate(
    repository: Path, name: str, *, max_batch_size: int = 1, instance_extra: str = ""
) -> Path:
    """The gate model ``name`` (one instance; ``instance_extra``: more of its instance group,
    such as a ``rate_limiter``) in ``repository``."""
    model_dir = repository / name
    (model_dir / "1").mkdir(parents=True)
    (model_dir / "1" / "model.py").write_text(_MODEL.replace("BLOCKER_ITERS", str(BLOCKER_ITERS)))
    (model_dir / "config.pbtxt").write_text(
        _CONFIG.format(name=name, max_batch_size=max_batch_size, instance_extra=instance_extra)
    )
    return model_dir


def open_gate(gate: Path, name: str) -> None:
    """Let the held request of model ``name`` (and every later one) through."""
    (gate / name).touch()


_WRAPPER = """name: "{name}"
platform: "ensemble"
max_batch_size: 1
input [ {{ name: "IN" data_type: TYPE_FP32 dims: [ 4 ] }},
        {{ name: "ITERS" data_type: TYPE_INT64 dims: [ 1 ] }} ]
output [ {{ name: "OUT" data_type: TYPE_FP32 dims: [ 4 ] }} ]
ensemble_scheduling {{ step [ {{ model_name: "{step}" model_version: -1
  input_map {{ key: "IN" value: "IN" }} input_map {{ key: "ITERS" value: "ITERS" }}
  output_map {{ key: "OUT" value: "OUT" }} }} ] }}
"""


def write_wrapper(repository: Path, name: str, step: str) -> Path:
    """An ensemble ``name`` of one step, ``step`` (a gate model or the slow model): the same
    inputs and output."""
    model_dir = repository / name
    (model_dir / "1").mkdir(parents=True)
    (model_dir / "config.pbtxt").write_text(_WRAPPER.format(name=name, step=step))
    return model_dir
