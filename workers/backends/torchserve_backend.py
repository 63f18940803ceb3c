"""TorchServe model archives (``backend: "torchserve"``, ``<version>/model.mar``): the
archive's handler runs as TorchServe runs it, on Sluice's batches.

The archive is unpacked into a private folder (:mod:`sluice.core.torchserve.archives`), and
TorchServe's own model loader (the ``ts`` package of ``torchserve``, in the ``torchserve``
extra) imports the handler: a handler file of the archive (a ``BaseHandler`` subclass with
``initialize`` / ``preprocess`` / ``inference`` / ``postprocess`` / ``handle``, or a module
with a ``handle`` function), a built-in handler's name, or the handler a registration named
instead of the manifest's (:mod:`sluice.core.torchserve.versions`). Its ``context`` is
TorchServe's: the manifest, ``system_properties`` (``model_dir``, ``gpu_id``,
``batch_size``), the archive's ``model-config.yaml`` (``model_yaml_config``), and each
request's headers, ``explain`` among them (``"True"`` for a request that came through
``/explanations``, :mod:`sluice.core.torchserve.explanations`: ``BaseHandler.handle`` then
calls ``explain_handle``; predictions and explanations batched together go to the handler
apart).

As TorchServe runs a worker, the model's folder is the process's working directory and is
on ``sys.path``, so that a handler opens the files of its archive (``--extra-files``) by
relative path. A worker process serves one model instance, so that is safe; the worker
resolves its own paths before (:func:`sluice.workers.inprocess.worker_for`), and ``close``
returns to the folder it came from.

Requests take TorchServe's shape: one dict per request, ``{"body": ...}`` for a raw body
(decoded as TorchServe's frontend does: JSON parsed, ``text/*`` as text, anything else as
bytes) or one entry per field of a ``multipart/form-data`` body. The model's tensors are
``body`` and ``content_type`` (BYTES) in, ``response`` and ``response_type`` (BYTES) out:
what ``POST /predictions/{model}`` sends, and what a KServe v2 client can send too. Each
row of the batch is one entry of the handler's list, so a KServe v2 request of several rows
is several entries. A handler that raises on a batch of several entries is run again on
each entry alone, so its error fails only the request that entry belongs to: a request
fails when any of its rows failed, with its first failed row's error, and the others of the
batch are answered. The error is TorchServe's (:func:`handler_failure`): 503 ``Prediction
failed``, a ``PredictionException``'s code and message, 507 ``Out of resources``; the
handler's exception goes to the worker's log. A status the handler set for an entry
(``context.set_response_status``) goes on its request's reply
(:mod:`sluice.core.torchserve.statuses`): a request's is its first row's other than 200.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import shutil
import sys
import tempfile
from collections.abc import Mapping, Sequence
from email.parser import BytesParser
from email.policy import HTTP
from pathlib import Path
from typing import Any

import numpy as np

from sluice.core.config import ModelConfig
from sluice.core.errors import HandlerFailed, InferenceFailed, InvalidConfig, SluiceError
from sluice.core.placement import Placement
from sluice.core.torchserve.archives import unpack
from sluice.core.torchserve.explanations import HEADER, header_value, is_explanation
from sluice.core.torchserve.statuses import STATUS, handler_status
from sluice.core.torchserve.versions import record_of
from sluice.workers.backends.base import RequestsFailed, missing_extra

log = logging.getLogger(__name__)

BODY, CONTENT_TYPE = "body", "content_type"
RESPONSE, RESPONSE_TYPE = "response", "response_type"

_JSON, _TEXT, _BINARY = "application/json", "text/plain", "application/octet-stream"

Answer = tuple[bytes, str, int]
"""One entry's answer: its bytes, their content type, and the status its handler set."""


def decode_value(content_type: str, value: bytes) -> Any:
    """A request part as TorchServe's backend hands it to handlers."""
    if content_type.startswith(_JSON):
        try:
            return json.loads(value)
        except ValueError:
            return bytearray(value)
    if content_type.startswith("text"):
        try:
            return value.decode()
        except UnicodeDecodeError:
            return bytearray(value)
    return bytearray(value)


def request_entry(content_type: str, body: bytes) -> tuple[dict[str, Any], dict[str, Any]]:
    """One request's dict for the handler, and its headers (TorchServe's RequestProcessor)."""
    if content_type.startswith("multipart/form-data"):
        message = BytesParser(policy=HTTP).parsebytes(
            b"Content-Type: " + content_type.encode() + b"\r\n\r\n" + body
        )
        entry: dict[str, Any] = {}
        headers: dict[str, Any] = {}
        for part in message.iter_parts():
            name = part.get_param("name", header="content-disposition") or "body"
            part_type = part.get_content_type() if part.get("content-type") else _BINARY
            payload = part.get_payload(decode=True)
            payload = payload if isinstance(payload, bytes) else b""
            entry[str(name)] = decode_value(part_type, payload)
            headers[str(name)] = {"content-type": part_type}
        return entry, headers
    return {BODY: decode_value(content_type, body)}, {BODY: {"content-type": content_type}}


def handler_failure(exc: BaseException) -> HandlerFailed:
    """What TorchServe answers every request of a batch whose handler raised ``exc``
    (``ts/service.py``): a ``PredictionException``'s own code and message, 507 ``Out of
    resources`` for memory (CUDA's included), else 503 ``Prediction failed``."""
    from ts.utils.util import PredictionException

    if isinstance(exc, PredictionException):
        code = exc.error_code if isinstance(exc.error_code, int) else 500
        return HandlerFailed(str(exc.message), code)
    if isinstance(exc, MemoryError) or "CUDA" in str(exc):
        return HandlerFailed("Out of resources", 507)
    return HandlerFailed("Prediction failed", 503)


def request_statuses(statuses: Sequence[int], owners: Sequence[int], requests: int) -> list[int]:
    """Each request's status from its rows' (``owners``: :func:`row_owners`): its first
    row's other than 200, else 200."""
    found = [200] * requests
    for row, status in enumerate(statuses):
        if status != 200 and found[owners[row]] == 200:
            found[owners[row]] = status
    return found


def encode_response(value: Any, content_type: str | None) -> tuple[bytes, str]:
    """A handler's answer for one request as bytes, with its content type."""
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value), content_type or _BINARY
    if isinstance(value, str):
        return value.encode(), content_type or _TEXT
    return json.dumps(value).encode(), content_type or _JSON


def _texts(array: np.ndarray | None, count: int, default: str) -> list[str]:
    if array is None:
        return [default] * count
    values = []
    for item in array.reshape(count, -1)[:, 0]:
        raw = item if isinstance(item, bytes) else str(item).encode()
        values.append(raw.decode(errors="replace") or default)
    return values


def row_owners(rows: int, request_sizes: Sequence[int] | None) -> list[int]:
    """The index in the batch of the request each row belongs to (``request_sizes`` None:
    the whole batch is one request). The handler is given one entry per row, so a request
    of several rows, from a KServe v2 client, owns several entries."""
    sizes = list(request_sizes) if request_sizes is not None else [rows]
    owners = [request for request, size in enumerate(sizes) for _ in range(size)]
    if len(owners) != rows:
        raise InferenceFailed(f"the batch's requests hold {len(owners)} rows, not {rows}")
    return owners


def explanation_rows(
    rows: int,
    request_sizes: Sequence[int] | None,
    parameters: Sequence[Mapping[str, Any]] | None,
) -> list[bool]:
    """Whether each row of a batch belongs to a request marked for explanation (a request
    of several rows, from a KServe v2 client, marks all of them)."""
    if parameters is None:
        return [False] * rows
    owners = row_owners(rows, request_sizes)
    requests = len(request_sizes) if request_sizes is not None else 1
    if len(parameters) != requests:
        raise InferenceFailed(f"the batch has {len(parameters)} parameters for {requests} requests")
    return [is_explanation(parameters[owner]) for owner in owners]


def request_failures(
    failed_rows: Mapping[int, SluiceError], owners: Sequence[int]
) -> dict[int, SluiceError]:
    """Each failed request's error, by its index in the batch, from the errors of the
    batch's failed rows (``owners``: :func:`row_owners`): a request fails when any of its
    rows failed, with the error of the first of them."""
    failures: dict[int, SluiceError] = {}
    for row in sorted(failed_rows):
        failures.setdefault(owners[row], failed_rows[row])
    return failures


class TorchServeBackend:
    reads_parameters = True
    """The worker hands over each request's parameters: the mark of an explanation."""

    def __init__(self, config: ModelConfig, model_path: Path, placement: Placement) -> None:
        try:
            from ts.metrics.metric_cache_yaml_impl import MetricsCacheYamlImpl
            from ts.model_loader import TsModelLoader
        except ImportError:
            raise missing_extra(config.name, "TorchServe's handler runtime", "torchserve") from None
        self._dir = Path(tempfile.mkdtemp(prefix="sluice-mar-"))
        self._came_from: str | None = None
        try:
            manifest = unpack(model_path, self._dir / "model")
            if manifest.requirements_file:
                log.warning(
                    "model '%s': the archive lists %s; Sluice does not install packages, "
                    "so the handler runs with what this environment has",
                    config.name,
                    manifest.requirements_file,
                )
            model_dir = str(self._dir / "model")
            self._came_from = os.getcwd()
            os.chdir(model_dir)
            sys.path.insert(0, model_dir)
            # The handler's files were written just now: imports must not go by directory
            # listings importlib cached before (another archive unpacked in this process).
            importlib.invalidate_caches()
            import ts

            metrics_file = Path(ts.__file__).parent / "configs" / "metrics.yaml"
            gpu = placement.gpu if placement.kind == "KIND_GPU" else None
            batch = max(1, config.max_batch_size)
            version = int(model_path.parent.name) if model_path.parent.name.isdigit() else 0
            handler = record_of(config.parameters, version).handler or manifest.handler
            self._service = TsModelLoader().load(
                config.name,
                model_dir,
                handler,
                gpu,
                batch,
                metrics_cache=MetricsCacheYamlImpl(config_file_path=str(metrics_file)),
            )
        except SluiceError:
            self.close()
            raise
        except Exception as exc:
            self.close()
            raise InvalidConfig(
                f"model '{config.name}': the archive's handler failed to initialize: "
                f"{type(exc).__name__}: {exc}"
            ) from None

    def infer(
        self,
        inputs: Mapping[str, np.ndarray],
        outputs: Sequence[str],
        request_sizes: Sequence[int] | None = None,
        parameters: Sequence[Mapping[str, Any]] | None = None,
        response_parameters: list[dict[str, Any]] | None = None,
    ) -> dict[str, np.ndarray]:
        """``response_parameters``: filled with each request's reply parameters, in order
        (the status its handler set, when not 200)."""
        bodies = inputs[BODY].reshape(len(inputs[BODY]), -1)[:, 0]
        types = _texts(inputs.get(CONTENT_TYPE), len(bodies), _BINARY)
        requests = [
            request_entry(kind, body if isinstance(body, bytes) else str(body).encode())
            for kind, body in zip(types, bodies, strict=True)
        ]
        owners = row_owners(len(requests), request_sizes)
        marks = explanation_rows(len(requests), request_sizes, parameters)
        answers: list[Answer] = [(b"", _TEXT, 200)] * len(requests)
        failed_rows: dict[int, SluiceError] = {}
        # TorchServe's handlers read the mark of a batch's first request for all of it:
        # predictions and explanations batched together go to the handler apart.
        for explain in (False, True):
            rows = [row for row, marked in enumerate(marks) if marked is explain]
            if rows:
                self._answer(requests, rows, explain, answers, failed_rows)
        if response_parameters is not None:
            count = len(request_sizes) if request_sizes is not None else 1
            statuses = request_statuses([status for _, _, status in answers], owners, count)
            response_parameters.extend({STATUS: s} if s != 200 else {} for s in statuses)
        if failed_rows:
            # (the worker reads failures by request, not by row)
            failures = request_failures(failed_rows, owners)
            if request_sizes is None or len(request_sizes) == 1:
                raise failures[0]
            raise RequestsFailed(failures, self._arrays(answers))
        return self._arrays(answers)

    def _answer(
        self,
        requests: list[tuple[dict[str, Any], dict[str, Any]]],
        rows: list[int],
        explain: bool,
        answers: list[Answer],
        failed_rows: dict[int, SluiceError],
    ) -> None:
        """The handler's answers to ``rows`` of the batch, in ``answers``; a handler that
        raises on several is run again on each alone, so that its error fails only the
        row that caused it (in ``failed_rows``)."""
        try:
            for row, answer in zip(
                rows, self._handle([requests[i] for i in rows], rows, explain), strict=True
            ):
                answers[row] = answer
            return
        except SluiceError as error:
            if len(rows) == 1:
                failed_rows[rows[0]] = error
                return
        for row in rows:
            self._answer(requests, [row], explain, answers, failed_rows)

    def _handle(
        self,
        requests: list[tuple[dict[str, Any], dict[str, Any]]],
        ids: Sequence[int],
        explain: bool,
    ) -> list[Answer]:
        from ts.context import RequestProcessor

        context = self._service.context
        context.request_ids = {i: str(request_id) for i, request_id in enumerate(ids)}
        mark = {HEADER: header_value(explain)}
        context.request_processor = [RequestProcessor(headers | mark) for _, headers in requests]
        context.metrics.request_ids = context.request_ids
        batch = [entry for entry, _ in requests]
        try:
            answers = self._service._entry_point(batch, context)
        except Exception as exc:
            log.warning("model '%s': the handler failed", context.model_name, exc_info=True)
            raise handler_failure(exc) from None
        if not isinstance(answers, list):
            log.warning(
                "model '%s': the handler answered %s, not a list",
                context.model_name,
                type(answers).__name__,
            )
            raise HandlerFailed("Invalid model predict output", 503)
        if len(answers) != len(batch):
            log.warning(
                "model '%s': the handler answered %d for %d request(s)",
                context.model_name,
                len(answers),
                len(batch),
            )
            raise HandlerFailed("number of batch response mismatched", 503)
        return [
            (
                *encode_response(value, context.get_response_content_type(index)),
                handler_status(context.get_response_status(index)[0]),
            )
            for index, value in enumerate(answers)
        ]

    @staticmethod
    def _arrays(answers: list[Answer]) -> dict[str, np.ndarray]:
        response = np.empty((len(answers), 1), dtype=np.object_)
        kinds = np.empty((len(answers), 1), dtype=np.object_)
        for index, (data, kind, _) in enumerate(answers):
            response[index, 0], kinds[index, 0] = data, kind.encode()
        return {RESPONSE: response, RESPONSE_TYPE: kinds}

    def close(self) -> None:
        model_dir = str(self._dir / "model")
        if model_dir in sys.path:
            sys.path.remove(model_dir)
        if self._came_from is not None:
            try:
                os.chdir(self._came_from)
            except OSError:
                os.chdir(tempfile.gettempdir())  # (the folder is gone; anywhere but ours)
            self._came_from = None
        shutil.rmtree(self._dir, ignore_errors=True)
