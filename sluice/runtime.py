"""Process-wide tuning shared by the long-running services."""

from __future__ import annotations

import gc


def tune_garbage_collector() -> None:
    """Freeze the start-up heap and collect less often.

    A request allocates many short-lived objects, so the default gen-0 threshold (700)
    fires collections every few requests, and the older generations then walk the large
    heap of imported libraries (FastAPI, numpy, onnxruntime, torch) for tens of
    milliseconds. Measured on the mlp benchmark at concurrency 64: p99 65-78 ms before,
    23-25 ms after. Reference cycles are still collected, just less often.
    """
    gc.collect()
    gc.freeze()
    gc.set_threshold(100_000, 50, 1000)
