"""A Python model whose config.pbtxt names only its backend, completed by its own
``auto_complete_config``, is served: the gateway's configuration and metadata show the
completed inputs and outputs, and it answers."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import httpx

from tests.support.stack import Stack
from tests.unit.core.test_python_autocomplete import COMPLETING


def test_a_self_completing_python_model_is_served(
    tmp_path: Path, start_stack: Callable[..., Stack]
) -> None:
    (tmp_path / "completed" / "1").mkdir(parents=True)
    (tmp_path / "completed" / "1" / "model.py").write_text(COMPLETING)
    (tmp_path / "completed" / "config.pbtxt").write_text('backend: "python"\n')
    stack = start_stack(tmp_path)
    with httpx.Client(base_url=stack.url, timeout=30) as http:
        config = http.get("/v2/models/completed/config").json()
        metadata = http.get("/v2/models/completed").json()
        body = {"inputs": [{"name": "X", "shape": [2, 3], "datatype": "FP32", "data": [1] * 6}]}
        answer = http.post("/v2/models/completed/infer", json=body)
    assert config["max_batch_size"] == 8 and "dynamic_batching" in config
    assert metadata["inputs"] == [{"name": "X", "datatype": "FP32", "shape": [-1, 3]}]
    assert answer.status_code == 200, answer.text
    assert answer.json()["outputs"][0]["data"] == [2.0] * 6
