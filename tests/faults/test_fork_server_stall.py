"""A fork server that stalls (stopped, here with SIGSTOP) while ``sluice up`` serves a worker
it forked and a request comes for another on-demand model: that model's worker is started
as a process of its own after one short wait, the forked worker goes on serving (it used to
be stopped with the server, after the tick loop had waited 25 s), and the worker the
server forks once it runs again, for the order given up on, is killed."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from tests.support import procs
from tests.support.model_files import write_model
from tests.support.stack import Stack
from tests.support.stubborn_models import CONFIG, REQUEST, model_source, pid_in

READY = "the fork server has done its imports"


def _log(stack: Stack) -> str:
    return "".join(stack.stderr_lines)


def _fork_server(parent: int) -> int | None:
    found = [pid for pid in procs.children(parent) if "--fork-server" in procs.cmdline(pid)]
    return found[0] if found else None


@pytest.mark.timeout(180)
def test_a_stalled_fork_server_delays_one_start_and_stops_no_worker(
    tmp_path: Path, start_stack: Callable[..., Stack]
) -> None:
    repository = tmp_path / "models"
    for name in ("first", "second"):
        source = model_source(tmp_path / f"{name}.pid")
        write_model(repository, name, CONFIG, {"1/model.py": source})
    stack = start_stack(repository, env={"SLUICE_MODEL_CONTROL_MODE": "demand"})
    assert stack.process is not None
    assert procs.wait_until(lambda: READY in _log(stack), 60), "the fork server never ready"
    server = _fork_server(stack.process.pid)
    assert server is not None
    try:
        with httpx.Client(base_url=stack.url, timeout=60) as http:
            assert http.post("/v2/models/first/infer", json=REQUEST).status_code == 200
            first = pid_in(tmp_path / "first.pid")
            assert first is not None and f"(pid {first}, forked)" in _log(stack)

            os.kill(server, signal.SIGSTOP)
            asked = time.monotonic()
            answer = http.post("/v2/models/second/infer", json=REQUEST)
            took_s = time.monotonic() - asked
            assert answer.status_code == 200, answer.text
            assert took_s < 20, took_s  # (it waited 10 s, then 15 s for the server to end)
            second = pid_in(tmp_path / "second.pid")
            assert second is not None and second in procs.children(stack.process.pid)
            assert "the fork server did not answer within" in _log(stack)

            assert procs.alive(first), "the worker the fork server forked was stopped"
            assert http.post("/v2/models/first/infer", json=REQUEST).status_code == 200
            assert pid_in(tmp_path / "first.pid") == first

            os.kill(server, signal.SIGCONT)
            assert procs.wait_until(lambda: "killing that one" in _log(stack), 30)
            assert procs.wait_until(lambda: procs.children(server) == {first}, 30)
            assert _fork_server(stack.process.pid) == server
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(server, signal.SIGCONT)
