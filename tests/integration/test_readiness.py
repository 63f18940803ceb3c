"""``/v2/health/ready`` follows Triton's strict readiness, with a switch.

Triton (``--strict-readiness=true``, its default) is ready only while every model is;
the shared integration stack serves two broken models, so it is live but not ready.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import httpx

from tests.integration.conftest import load_examples_builder
from tests.support.stack import Stack


def test_not_ready_while_a_model_is_unavailable(stack: Stack) -> None:
    with httpx.Client(base_url=stack.url, timeout=10) as http:
        assert http.get("/v2/health/live").json() == {"live": True}
        response = http.get("/v2/health/ready")
        assert response.status_code == 400
        message = response.json()["error"]
        assert message.startswith("server is not ready: model(s) not ready: ")
        assert "'broken_config' (unavailable)" in message
        assert "'corrupt_model' version 1 (unavailable)" in message
        assert "'iris'" not in message
        assert http.get("/v2/models/iris/ready").status_code == 200


def test_ready_once_every_model_is_and_the_switch_turns_strictness_off(
    tmp_path: Path, start_stack: Callable[..., Stack]
) -> None:
    load_examples_builder().build_all(tmp_path, models=("mlp",))
    broken = tmp_path / "broken" / "1"
    broken.mkdir(parents=True)
    (tmp_path / "broken" / "config.pbtxt").write_text('name: "broken"\nmax_batch_size: x\n')
    lenient = start_stack(tmp_path, env={"SLUICE_STRICT_READINESS": "false"})
    with httpx.Client(base_url=lenient.url, timeout=10) as http:
        assert http.get("/v2/health/ready").json() == {"ready": True}
    (tmp_path / "broken" / "config.pbtxt").unlink()
    (tmp_path / "broken" / "1").rmdir()
    (tmp_path / "broken").rmdir()
    strict = start_stack(tmp_path)
    with httpx.Client(base_url=strict.url, timeout=10) as http:
        assert http.get("/v2/health/ready").json() == {"ready": True}
