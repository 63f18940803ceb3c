"""A running total per sequence, with Sluice's Python model API and Triton's implicit state.

``execute`` receives a batch of requests from different sequences (one row each):
``INPUT`` the value sent, ``ACC_IN`` the sequence's total so far (the state the server
keeps), ``START`` 1 on a sequence's first request. It returns the new total both as the
answer (``OUTPUT``) and as the next state (``ACC_OUT``).
"""

from __future__ import annotations

import numpy as np


class Model:
    def execute(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        previous = np.where(inputs["START"] != 0, 0.0, inputs["ACC_IN"]).astype(np.float32)
        total = previous + inputs["INPUT"].astype(np.float32)
        return {"OUTPUT": total, "ACC_OUT": total}
