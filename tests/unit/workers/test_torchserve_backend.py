"""The TorchServe backend runs a handler as TorchServe's worker does: in the model's folder,
which is on ``sys.path``, with the handler a registration named instead of the manifest's,
and the ``explain`` header TorchServe's frontend sets; closing it returns to where the
process was."""

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
from sluice.core.torchserve.explanations import EXPLAIN
from sluice.core.torchserve.versions import VersionRecord
from sluice.workers.backends.torchserve_backend import TorchServeBackend, explanation_rows

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
EXPLAINER = """
class Explained:
    \"\"\"A custom handler class answering what TorchServe's BaseHandler.handle branches on:
    the explain header of the batch's first request.\"\"\"

    def initialize(self, context):
        pass

    def handle(self, data, context):
        explain = context.get_request_header(0, "explain")
        texts = [row["body"] for row in data]  # (text/plain: text)
        if explain == "True":
            return [f"why {text} in {len(data)} ({explain})" for text in texts]
        return [f"{text.upper()} in {len(data)} ({explain})" for text in texts]
"""


def _model(
    tmp_path: Path, handler: str = "", source: tuple[str, str] = ("h.py", HANDLER)
) -> tuple[Path, TorchServeBackend]:
    """``source``: the manifest's handler file and its text (a name of its own per text:
    the process imports each module once)."""
    path = tmp_path / "m" / "1" / "model.mar"
    path.parent.mkdir(parents=True)
    file, text = source
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(MANIFEST, json.dumps({"model": {"modelName": "m", "handler": file}}))
        archive.writestr(file, text)
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


def test_an_explanation_runs_explain_handle_and_a_batch_goes_to_the_handler_by_kind(
    tmp_path: Path,
) -> None:
    """TorchServe's ``BaseHandler.handle`` reads the ``explain`` header of the batch's first
    request for all of it: predictions and explanations batched together are handed over
    apart, each with its mark, and answered in their places."""
    _, backend = _model(tmp_path, source=("explainer.py", EXPLAINER))
    try:
        texts = [b"a", b"b", b"c", b"d", b"e"]
        body = np.array([[text] for text in texts], dtype=np.object_)
        kind = np.array([[b"text/plain"]] * len(texts), dtype=np.object_)
        marked = {EXPLAIN: True}
        answer = backend.infer(
            {"body": body, "content_type": kind},
            ["response"],
            request_sizes=[1, 1, 2, 1],
            parameters=[{}, marked, {"explain": True}, marked],
        )
        said = [bytes(row[0]).decode() for row in answer["response"]]
        assert said == [
            "A in 3 (False)",
            "why b in 2 (True)",
            "C in 3 (False)",
            "D in 3 (False)",
            "why e in 2 (True)",
        ]
        # (a client's own parameter named like the header marks nothing; nor does no
        # parameter at all: warm-up, or an older worker's call)
        alone = backend.infer({"body": body[:1], "content_type": kind[:1]}, ["response"])
        assert bytes(alone["response"][0, 0]) == b"A in 1 (False)"
    finally:
        backend.close()


def test_a_request_of_several_rows_marks_each_of_them() -> None:
    marked = {EXPLAIN: True}
    assert explanation_rows(3, [2, 1], [marked, {}]) == [True, True, False]
    assert explanation_rows(2, None, [marked]) == [True, True]
    assert explanation_rows(2, [1, 1], None) == [False, False]
    assert explanation_rows(1, None, [{EXPLAIN: "True"}]) == [False]  # (True itself only)
