"""A decoupled model written for Triton's Python backend: one response per word.

Each request's response sender sends the words one by one; the last ``send`` carries
``TRITONSERVER_RESPONSE_COMPLETE_FINAL``. Text that is not UTF-8 is answered with an error.
"""

from __future__ import annotations

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            raw = pb_utils.get_input_tensor_by_name(request, "text_input").as_numpy()
            try:
                words = raw.reshape(-1)[0].decode("utf-8").split()
            except UnicodeDecodeError:
                error = pb_utils.TritonError("text_input is not valid UTF-8")
                sender.send(
                    pb_utils.InferenceResponse(error=error),
                    flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL,
                )
                continue
            for word in words:
                token = pb_utils.Tensor("text_output", np.array([word.encode()], dtype=object))
                sender.send(pb_utils.InferenceResponse([token]))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
