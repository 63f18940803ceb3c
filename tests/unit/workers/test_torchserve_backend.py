"""The TorchServe backend runs a handler as TorchServe's worker does: in the model's folder,
which is on ``sys.path``, with the handler a registration named instead of the manifest's;
closing it returns to where the process was."""

from __future__ import annotations

import json
import os
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest

from sluice.core.config import parse_config_text
from sluice.core.errors import InvalidConfig
from sluice.core.placement import Placement
from sluice.core.torchserve.archives import MANIFEST
from sluice.core.torchserve.config import triton_config
from sluice.core.torchserve.versions import VersionRecord
from sluice.workers.backends.torchserve_backend import TorchServeBackend

pytest.importorskip("ts")
# TorchServe's metrics cache (ts.metrics.metric_cache_yaml_impl) leaves its YAML file open.
pytestmark = [
    pytest.mark.filterwarnings("ignore::ResourceWarning"),
    pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning"),
]

HANDLER = """
import os

from ts_backend_test_helper import shout


def handle(data, context):
    if data is None:
        return None
    with open("words.txt") as f:
        word = f.read().strip()
    return [shout(word) + " from " + os.getcwd() for _ in data]
"""
OTHER = "def handle(data, context):\n    return None if data is None else ['other' for _ in data]\n"


def _model(tmp_path: Path, handler: str = "") -> tuple[Path, TorchServeBackend]:
    path = tmp_path / "m" / "1" / "model.mar"
    path.parent.mkdir(parents=True)
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(MANIFEST, json.dumps({"model": {"modelName": "m", "handler": "h.py"}}))
        archive.writestr("h.py", HANDLER)
        archive.writestr("other.py", OTHER)
        archive.writestr("ts_backend_test_helper.py", "def shout(text):\n    return text.upper()\n")
        archive.writestr("words.txt", "hello\n")
    record = VersionRecord("1.0", handler=handler)
    config = parse_config_text(triton_config("m", 2, versions={1: record}), model_name="m")
    return path, TorchServeBackend(config, path, Placement())


def _ask(backend: TorchServeBackend) -> str:
    body = np.array([[b"x"]], dtype=np.object_)
    kind = np.array([[b"text/plain"]], dtype=np.object_)
    answer = backend.infer({"body": body, "content_type": kind}, ["response"])
    return bytes(answer["response"][0, 0]).decode()


def test_the_handler_runs_in_its_model_s_folder_and_close_returns(tmp_path: Path) -> None:
    before = os.getcwd()
    _, backend = _model(tmp_path)
    try:
        folder = os.getcwd()
        assert folder != before and folder in sys.path
        assert _ask(backend) == f"HELLO from {folder}"
    finally:
        backend.close()
    assert os.getcwd() == before and folder not in sys.path and not Path(folder).exists()


def test_a_registration_s_handler_comes_before_the_manifest_s(tmp_path: Path) -> None:
    before = os.getcwd()
    _, backend = _model(tmp_path, handler="other.py")
    try:
        assert _ask(backend) == "other"
    finally:
        backend.close()
    with pytest.raises(InvalidConfig, match="the archive's handler failed to initialize"):
        _model(tmp_path / "bad", handler="invalidHandler")
    assert os.getcwd() == before


def test_a_worker_s_model_path_is_absolute_before_any_backend_moves(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker's own paths (the model file, the warm-up samples beside it) must not
    depend on the working directory a backend changes."""
    from sluice.core.settings import WorkerSettings
    from sluice.workers.inprocess import worker_for
    from tests.support.onnx_models import write_identity

    write_identity(tmp_path / "repository", "ident", ["FP32"])
    monkeypatch.chdir(tmp_path)
    worker = worker_for(WorkerSettings(), Path("repository"), "ident")
    assert worker.model_path.is_absolute()
    assert worker.model_path == tmp_path / "repository" / "ident" / "1" / "model.onnx"
