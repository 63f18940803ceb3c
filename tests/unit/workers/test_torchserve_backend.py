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
from sluice.core.errors import InferenceFailed, InvalidConfig
from sluice.core.placement import Placement
from sluice.core.torchserve.archives import MANIFEST
from sluice.core.torchserve.config import triton_config
from sluice.core.torchserve.explanations import EXPLAIN
from sluice.core.torchserve.versions import VersionRecord
from sluice.workers.backends.base import RequestsFailed
from sluice.workers.backends.torchserve_backend import (
    TorchServeBackend,
    explanation_rows,
    request_failures,
    row_owners,
)

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

ROW_FAILING = """
def handle(data, context):
    \"\"\"Fails a batch holding a row "bad": on a prediction, or "worse" on an explanation.\"\"\"
    if data is None:
        return None
    explain = context.get_request_header(0, "explain") == "True"
    texts = [row["body"] for row in data]
    if ("worse" if explain else "bad") in texts:
        raise ValueError("the row " + ("worse" if explain else "bad"))
    return [("why " if explain else "") + text.upper() for text in texts]
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


def _rows(texts: list[bytes]) -> dict[str, np.ndarray]:
    body = np.array([[text] for text in texts], dtype=np.object_)
    kind = np.array([[b"text/plain"]] * len(texts), dtype=np.object_)
    return {"body": body, "content_type": kind}


def _said(outputs: dict[str, np.ndarray], rows: list[int]) -> list[str]:
    return [bytes(outputs["response"][row, 0]).decode() for row in rows]


def test_a_failed_row_fails_the_request_it_belongs_to(tmp_path: Path) -> None:
    """The handler is given one entry per row; a request of several rows (a KServe v2
    client's) fails when one of them fails, and the batch's other requests keep their
    answers. The worker reads the failures by request, not by row."""
    _, backend = _model(tmp_path, source=("row_failing.py", ROW_FAILING))
    try:
        with pytest.raises(RequestsFailed) as raised:
            backend.infer(
                _rows([b"a", b"b", b"bad", b"c", b"d"]), ["response"], request_sizes=[1, 3, 1]
            )
        assert set(raised.value.failures) == {1}
        assert raised.value.failures[1].message == "the handler failed: ValueError: the row bad"
        assert raised.value.outputs is not None
        assert _said(raised.value.outputs, [0, 4]) == ["A", "D"]
        # A batch of one request of several rows: that request's error itself.
        with pytest.raises(InferenceFailed) as alone:
            backend.infer(_rows([b"a", b"bad", b"c"]), ["response"], request_sizes=[3])
        assert not isinstance(alone.value, RequestsFailed)
        assert alone.value.message == "the handler failed: ValueError: the row bad"
        with pytest.raises(InferenceFailed, match=r"the row bad$") as whole:
            backend.infer(_rows([b"bad", b"a"]), ["response"])
        assert not isinstance(whole.value, RequestsFailed)
    finally:
        backend.close()


def test_predictions_and_explanations_apart_keep_the_rows_requests(tmp_path: Path) -> None:
    """A mixed batch goes to the handler apart, by kind: the rows that fail in either part
    still fail the requests they belong to."""
    _, backend = _model(tmp_path, source=("row_failing_explained.py", ROW_FAILING))
    marked = {EXPLAIN: True}
    try:
        with pytest.raises(RequestsFailed) as raised:
            backend.infer(
                _rows([b"a", b"b", b"c", b"d", b"bad", b"worse", b"e", b"f", b"bad"]),
                ["response"],
                request_sizes=[2, 1, 2, 2, 1, 1],
                parameters=[{}, marked, {}, marked, {}, marked],
            )
        assert {i: e.message for i, e in raised.value.failures.items()} == {
            2: "the handler failed: ValueError: the row bad",
            3: "the handler failed: ValueError: the row worse",
        }
        assert raised.value.outputs is not None
        assert _said(raised.value.outputs, [0, 1, 2, 7, 8]) == ["A", "B", "why C", "F", "why BAD"]
    finally:
        backend.close()


def test_each_row_s_request_and_each_request_s_first_failure() -> None:
    assert row_owners(5, [1, 3, 1]) == [0, 1, 1, 1, 2]
    assert row_owners(2, None) == [0, 0]
    with pytest.raises(InferenceFailed, match="hold 4 rows, not 5"):
        row_owners(5, [1, 3])
    first, second = InferenceFailed("first"), InferenceFailed("second")
    assert request_failures({3: second, 2: first}, [0, 1, 1, 1, 2]) == {1: first}
    assert request_failures({4: second, 0: first}, [0, 1, 1, 1, 2]) == {0: first, 2: second}
