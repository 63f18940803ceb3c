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
from sluice.core.errors import HandlerFailed, InferenceFailed, InvalidConfig
from sluice.core.placement import Placement
from sluice.core.torchserve.archives import MANIFEST
from sluice.core.torchserve.config import triton_config
from sluice.core.torchserve.explanations import EXPLAIN
from sluice.core.torchserve.statuses import STATUS
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
        assert raised.value.failures[1].message == "Prediction failed"
        assert raised.value.outputs is not None
        assert _said(raised.value.outputs, [0, 4]) == ["A", "D"]
        # A batch of one request of several rows: that request's error itself.
        with pytest.raises(InferenceFailed) as alone:
            backend.infer(_rows([b"a", b"bad", b"c"]), ["response"], request_sizes=[3])
        assert not isinstance(alone.value, RequestsFailed)
        assert alone.value.message == "Prediction failed"
        with pytest.raises(InferenceFailed, match=r"^Prediction failed$") as whole:
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
            2: "Prediction failed",
            3: "Prediction failed",
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


STATUSES = """
from ts.utils.util import PredictionException


def handle(data, context):
    \"\"\"Answers each entry by its text: "teapot" with a status of its own (and its body),
    "refuse" with a PredictionException, "boom" by raising, "few" with too few answers,
    "dict" with no list at all.\"\"\"
    if data is None:
        return None
    texts = [row["body"] for row in data]
    if "refuse" in texts:
        raise PredictionException("no such thing", 422)
    if "boom" in texts:
        raise RuntimeError("a handler's own trouble")
    if "few" in texts:
        return texts[1:]
    if "dict" in texts:
        return {"not": "a list"}
    for index, text in enumerate(texts):
        if text == "teapot":
            context.set_response_status(418, "I'm a teapot", index)
    return ["short and stout" if text == "teapot" else text.upper() for text in texts]
"""


def test_a_status_the_handler_sets_goes_on_its_request_s_reply(tmp_path: Path) -> None:
    """TorchServe answers an entry with the status its handler set for it
    (``context.set_response_status``); a request of several rows has its first row's."""
    _, backend = _model(tmp_path, source=("statuses_set.py", STATUSES))
    try:
        replied: list[dict[str, object]] = []
        answer = backend.infer(
            _rows([b"a", b"teapot", b"b", b"c", b"teapot"]),
            ["response"],
            request_sizes=[1, 1, 2, 1],
            response_parameters=replied,
        )
        assert replied == [{}, {STATUS: 418}, {}, {STATUS: 418}]
        assert _said(answer, [0, 1, 2, 4]) == ["A", "short and stout", "B", "short and stout"]
        # (the next batch starts from 200 again)
        replied.clear()
        backend.infer(_rows([b"a"]), ["response"], response_parameters=replied)
        assert replied == [{}]
    finally:
        backend.close()


@pytest.mark.parametrize(
    ("text", "status", "message"),
    [
        (b"refuse", 422, "no such thing"),
        (b"boom", 503, "Prediction failed"),
        (b"few", 503, "number of batch response mismatched"),
        (b"dict", 503, "Invalid model predict output"),
    ],
)
def test_a_handler_that_fails_is_answered_with_torchserve_s_status_and_text(
    tmp_path: Path, text: bytes, status: int, message: str
) -> None:
    """TorchServe's answers (ts/service.py): a PredictionException's code and message, else
    503 with its own words; only the request whose entry failed gets it."""
    _, backend = _model(tmp_path, source=(f"statuses_{text.decode()}.py", STATUSES))
    try:
        with pytest.raises(RequestsFailed) as raised:
            backend.infer(_rows([b"a", text, b"b"]), ["response"], request_sizes=[1, 1, 1])
        (failure,) = raised.value.failures.values()
        assert set(raised.value.failures) == {1}
        assert isinstance(failure, HandlerFailed)
        assert (int(failure.status), failure.message) == (status, message)
        assert raised.value.outputs is not None
        assert _said(raised.value.outputs, [0, 2]) == ["A", "B"]
    finally:
        backend.close()
