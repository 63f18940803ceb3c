"""Choosing the Kubernetes executor: clear refusals when it cannot work from here."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from sluice.core.settings import ControllerSettings
from sluice.scheduler.executor.kubernetes import ExecutorUnavailable, apps_api, start_executor

ROOT = Path(__file__).resolve().parents[3]


def test_the_local_executor_starts_nothing() -> None:
    assert start_executor(ControllerSettings(), None, threading.Event()) is None


def test_without_the_kubernetes_package_the_message_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "kubernetes", None)  # import kubernetes -> ImportError
    with pytest.raises(ExecutorUnavailable, match=r"pip install 'sluice\[kubernetes\]'"):
        apps_api(ControllerSettings(executor="kubernetes"))


def test_without_a_cluster_configuration_the_message_says_where_it_looked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "nowhere"))
    with pytest.raises(ExecutorUnavailable) as raised:
        apps_api(ControllerSettings(executor="kubernetes"))
    message = raised.value.message
    assert "no cluster configuration" in message
    assert "not in a pod" in message
    assert str(tmp_path / "nowhere") in message


def test_sluice_controller_refuses_in_one_line(tmp_path: Path) -> None:
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("SLUICE_", "KUBERNETES_"))
    }
    env.update(
        SLUICE_EXECUTOR="kubernetes",
        KUBECONFIG=str(tmp_path / "nowhere"),
        SLUICE_REDIS_URL="redis://127.0.0.1:1/0",  # never reached: the refusal comes first
        PYTHONPATH=str(ROOT),
    )
    done = subprocess.run(
        [sys.executable, "-c", "from sluice.cli import app; app()", "controller"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert done.returncode == 2, done.stderr
    assert "error: SLUICE_EXECUTOR=kubernetes found no cluster configuration" in done.stderr
    assert "Traceback" not in done.stderr
