"""Text statistics, a preprocessing step written with Sluice's Python model API.

``execute`` receives a whole batch: ``TEXT`` is an object array of bytes of shape
[batch, 1]. It returns, per string, the number of whitespace-separated tokens and
of Unicode characters (invalid UTF-8 is decoded with replacement characters).
"""

from __future__ import annotations

import numpy as np


class Model:
    def execute(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        text = inputs["TEXT"]
        decoded = [value.decode("utf-8", errors="replace") for value in text.reshape(-1)]
        tokens = np.array([len(value.split()) for value in decoded], dtype=np.int64)
        characters = np.array([len(value) for value in decoded], dtype=np.int64)
        return {"TOKENS": tokens.reshape(text.shape), "CHARACTERS": characters.reshape(text.shape)}
