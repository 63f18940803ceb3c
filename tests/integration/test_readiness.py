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


def _empty(response: httpx.Response, status: int) -> bool:
    """Triton's health answer: the status, no body."""
    return (response.status_code, response.content) == (status, b"")


def test_not_ready_while_a_model_is_unavailable(stack: Stack) -> None:
    with httpx.Client(base_url=stack.url, timeout=10) as http:
        live = http.get("/v2/health/live")
        assert _empty(live, 200) and live.headers["content-length"] == "0"
        assert _empty(http.get("/v2/health/ready"), 400)  # (no reason, as Triton)
        assert _empty(http.get("/v2/models/iris/ready"), 200)
        broken = http.get("/v2/models/broken_config/ready")
        assert broken.status_code == 400
        assert broken.json()["error"].startswith("Model version not ready")


def test_ready_once_every_model_is_and_the_switch_turns_strictness_off(
    tmp_path: Path, start_stack: Callable[..., Stack]
) -> None:
    load_examples_builder().build_all(tmp_path, models=("mlp",))
    broken = tmp_path / "broken" / "1"
    broken.mkdir(parents=True)
    (tmp_path / "broken" / "config.pbtxt").write_text('name: "broken"\nmax_batch_size: x\n')
    lenient = start_stack(tmp_path, env={"SLUICE_STRICT_READINESS": "false"})
    with httpx.Client(base_url=lenient.url, timeout=10) as http:
        assert _empty(http.get("/v2/health/ready"), 200)
    (tmp_path / "broken" / "config.pbtxt").unlink()
    (tmp_path / "broken" / "1").rmdir()
    (tmp_path / "broken").rmdir()
    strict = start_stack(tmp_path)
    with httpx.Client(base_url=strict.url, timeout=10) as http:
        assert _empty(http.get("/v2/health/ready"), 200)
