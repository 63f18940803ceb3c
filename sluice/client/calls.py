"""Everything the two clients share but I/O: each API call as a :class:`Call` (the HTTP
request to send and how to read its answer), the retry policy, and the pacing of
:meth:`~sluice.client.Client.wait_job`. :class:`~sluice.client.Client` and
:class:`~sluice.client.AsyncClient` only send, sleep and loop.
"""

from __future__ import annotations

import json
import math
import os
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar
from urllib.parse import quote

import httpx
import numpy as np

from sluice import __version__
from sluice.client.codec import (
    HEADER_LENGTH,
    Body,
    decode_response,
    encode_json_request,
)
from sluice.client.errors import (
    BatchFailed,
    JobNotFinished,
    MalformedResponse,
    ServerUnreachable,
    error_for,
    retry_after_s,
)
from sluice.client.transfers import (
    UploadSource,
    checked_output_files,
    checked_upload,
    upload_headers,
)
from sluice.core.errors import DeadlineExceeded, SluiceError, Unsupported

T = TypeVar("T")

RETRY_STATUSES = frozenset({429, 503})
USER_AGENT = f"sluice-client/{__version__}"
MAX_JOB_WAIT_S = 30
"""Longest ``Prefer: wait`` one result request asks for while waiting for a job."""


@dataclass(frozen=True, slots=True)
class Call(Generic[T]):
    """One API call: what to send, and ``parse`` to turn the final answer into a value (or
    raise the server's error)."""

    method: str
    path: str
    parse: Callable[[httpx.Response], T]
    headers: Mapping[str, str] = field(default_factory=dict)
    content: bytes | None = None
    retry: bool = True
    """Whether 429, 503 and connection failures are retried."""
    extra_timeout_s: float = 0.0
    """Added to the client's timeout (a result request the server holds on purpose)."""
    retry_statuses: frozenset[int] = RETRY_STATUSES
    """The answers that are retried (when ``retry``)."""
    resend_after_sent: bool = True
    """Whether a call whose connection failed after it was sent may be sent again; False
    for a call that creates something each time (an upload), where only a connection that
    was never made is retried."""
    upload: UploadSource | None = None
    """A local file streamed as the body instead of ``content``, read again on each try."""


@dataclass(frozen=True, slots=True)
class Job:
    """A submitted job: its id, its absolute URL and its status when last seen."""

    id: str
    url: str
    status: dict[str, Any]


def job_id_of(job: str | Job) -> str:
    return job.id if isinstance(job, Job) else job


DEFAULT_URL = "http://127.0.0.1:8000"
URL_VARIABLE = "SLUICE_URL"
KEY_VARIABLE = "SLUICE_API_KEY"


def gateway_url(url: str | None) -> str:
    """The gateway to call: ``url``, else ``SLUICE_URL``, else a local one (as the
    ``sluice`` commands read them)."""
    chosen = url or os.environ.get(URL_VARIABLE, "").strip() or DEFAULT_URL
    return chosen.rstrip("/")


def api_key_of(api_key: str | None) -> str | None:
    """``api_key``, else ``SLUICE_API_KEY`` when set."""
    return api_key or os.environ.get(KEY_VARIABLE, "").strip() or None


def client_headers(api_key: str | None) -> dict[str, str]:
    headers = {"User-Agent": USER_AGENT}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    return headers


# ----------------------------------------------------------------------------- retries


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """Retry 429, 503 and lost connections up to ``retries`` times: after the server's
    ``Retry-After`` when it sent one (at most ``max_retry_after_s``), otherwise after an
    exponential backoff with jitter (``first_s`` doubling, at most ``max_backoff_s``)."""

    retries: int
    first_s: float = 0.1
    max_backoff_s: float = 5.0
    max_retry_after_s: float = 30.0

    def after_response(
        self, call: Call[Any], attempt: int, response: httpx.Response
    ) -> float | None:
        """Seconds to wait before sending ``call`` again (``attempt`` retries done so far),
        or None to keep this answer."""
        if not call.retry or attempt >= self.retries:
            return None
        if response.status_code not in call.retry_statuses:
            return None
        delay = retry_after_s(response.headers.get("retry-after"))
        if delay is not None:
            return min(delay, self.max_retry_after_s)
        return self.backoff_s(attempt)

    def after_error(
        self, call: Call[Any], attempt: int, error: httpx.TransportError
    ) -> float | None:
        """Seconds to wait before sending ``call`` again after no answer came, or None to
        give up."""
        if not call.retry or attempt >= self.retries or not retryable(error):
            return None
        if not call.resend_after_sent and not isinstance(
            error, httpx.ConnectError | httpx.ConnectTimeout
        ):
            return None
        return self.backoff_s(attempt)

    def backoff_s(self, attempt: int) -> float:
        ceiling = min(self.max_backoff_s, self.first_s * 2.0 ** min(attempt, 62))
        return random.uniform(ceiling / 2, ceiling)


def retryable(error: httpx.TransportError) -> bool:
    """Connection failures, refused or dropped; not a timeout waiting for the answer (the
    server may still be computing it, sending it again would only add load)."""
    return isinstance(
        error,
        httpx.ConnectError
        | httpx.ConnectTimeout
        | httpx.ReadError
        | httpx.WriteError
        | httpx.RemoteProtocolError,
    )


def transport_failure(url: str, error: httpx.TransportError) -> SluiceError:
    """The exception for a call that got no HTTP answer."""
    detail = str(error) or type(error).__name__
    if isinstance(error, httpx.TimeoutException) and not isinstance(
        error, httpx.ConnectTimeout | httpx.PoolTimeout
    ):
        return DeadlineExceeded(f"no answer from {url} in time: {detail}")
    return ServerUnreachable(f"cannot reach {url}: {detail}")


# ------------------------------------------------------------------------ answer parsing


def raise_for_error(response: httpx.Response) -> None:
    if response.status_code >= 400:
        raise answer_error(response)


def answer_error(response: httpx.Response) -> SluiceError:
    """The exception of an error answer (its body read)."""
    return error_for(response.status_code, response.content, response.headers.get("retry-after"))


def json_answer(response: httpx.Response) -> dict[str, Any]:
    """The JSON object of a successful answer; the server's error otherwise."""
    raise_for_error(response)
    try:
        document = json.loads(response.content)
    except (ValueError, UnicodeDecodeError):
        document = None
    if not isinstance(document, dict):
        raise MalformedResponse(
            f"malformed response: {response.request.method} {response.request.url.path} "
            "did not answer a JSON object"
        )
    return document


def tensors_answer(response: httpx.Response) -> dict[str, np.ndarray]:
    raise_for_error(response)
    return decode_response(response.content, response.headers.get(HEADER_LENGTH))


def _ready_answer(response: httpx.Response) -> bool:
    return response.status_code == 200


def _job_answer(response: httpx.Response) -> Job:
    if response.status_code == 200:
        raise Unsupported(
            "the server answered the job synchronously: it does not support 'Prefer: respond-async'"
        )
    status = json_answer(response)
    location = response.headers.get("location")
    job_id = location.rstrip("/").rsplit("/", 1)[-1] if location else status.get("id")
    if not isinstance(job_id, str) or not job_id:
        raise MalformedResponse("malformed response: the job's answer has no Location nor id")
    url = str(response.url.join(location or f"/v2/jobs/{quote(job_id, safe='')}"))
    return Job(job_id, url, status)


def _result_answer(response: httpx.Response) -> dict[str, np.ndarray]:
    if response.status_code == 202:
        status = json_answer(response)
        job_id = status.get("id", "?")
        raise JobNotFinished(
            f"job '{job_id}' is not finished (status: {status.get('status', '?')})", status
        )
    return tensors_answer(response)


def _output_files_answer(response: httpx.Response) -> list[dict[str, Any]]:
    return checked_output_files(json_answer(response))


def _uploads_answer(response: httpx.Response) -> list[dict[str, Any]]:
    items = json_answer(response).get("uploads")
    if not isinstance(items, list):
        raise MalformedResponse("malformed response: GET /v2/uploads has no 'uploads' list")
    return items


def _batches_answer(response: httpx.Response) -> list[dict[str, Any]]:
    batches = json_answer(response).get("batches")
    if not isinstance(batches, list):
        raise MalformedResponse("malformed response: GET /v2/batches has no 'batches' list")
    return batches


# ----------------------------------------------------------------------------- calls


def _model_path(model: str, version: int | None) -> str:
    path = f"/v2/models/{quote(model, safe='')}"
    return path if version is None else f"{path}/versions/{int(version)}"


def _job_path(job_id: str) -> str:
    return f"/v2/jobs/{quote(job_id, safe='')}"


def _batch_path(batch_id: str) -> str:
    return f"/v2/batches/{quote(batch_id, safe='')}"


def ready() -> Call[bool]:
    return Call("GET", "/v2/health/ready", _ready_answer, retry=False)


def model_metadata(model: str, version: int | None = None) -> Call[dict[str, Any]]:
    return Call("GET", _model_path(model, version), json_answer)


def infer(model: str, body: Body, version: int | None = None) -> Call[dict[str, np.ndarray]]:
    return Call(
        "POST", f"{_model_path(model, version)}/infer", tensors_answer, body.headers(), body.content
    )


def submit_job(
    model: str, body: Body, version: int | None = None, idempotency_key: str | None = None
) -> Call[Job]:
    headers = {**body.headers(), "Prefer": "respond-async"}
    if idempotency_key is not None:
        headers["Idempotency-Key"] = idempotency_key
    return Call("POST", f"{_model_path(model, version)}/infer", _job_answer, headers, body.content)


def job(job_id: str) -> Call[dict[str, Any]]:
    return Call("GET", _job_path(job_id), json_answer)


def job_result(job_id: str, wait_s: float = 0.0) -> Call[dict[str, np.ndarray]]:
    """A 429 here is the error of a finished job (its answer was not kept, its tenant at
    its limit): final, so not retried."""
    seconds = max(0, math.ceil(wait_s))
    headers = {"Prefer": f"wait={seconds}"} if seconds else {}
    return Call(
        "GET",
        f"{_job_path(job_id)}/result",
        _result_answer,
        headers,
        extra_timeout_s=seconds,
        retry_statuses=RETRY_STATUSES - {429},
    )


def cancel_job(job_id: str) -> Call[dict[str, Any]]:
    return Call("DELETE", _job_path(job_id), json_answer)


def submit_batch(
    model: str, input: str, output: str | None, version: int | None, options: Mapping[str, Any]
) -> Call[dict[str, Any]]:
    """``output`` None: the server keeps the outputs in its store, under the batch's id."""
    document: dict[str, Any] = {"model": model, "input": input}
    if output is not None:
        document["output"] = output
    if version is not None:
        document["version"] = version
    document["options"] = dict(options)
    body = encode_json_request(document)
    return Call("POST", "/v2/batches", json_answer, body.headers(), body.content)


def batch(batch_id: str) -> Call[dict[str, Any]]:
    return Call("GET", _batch_path(batch_id), json_answer)


def cancel_batch(batch_id: str) -> Call[dict[str, Any]]:
    return Call("POST", f"{_batch_path(batch_id)}/cancel", json_answer)


def resume_batch(batch_id: str) -> Call[dict[str, Any]]:
    return Call("POST", f"{_batch_path(batch_id)}/resume", json_answer)


def batches() -> Call[list[dict[str, Any]]]:
    return Call("GET", "/v2/batches", _batches_answer)


def delete_batch(batch_id: str) -> Call[None]:
    return Call("DELETE", _batch_path(batch_id), raise_for_error)


def batch_outputs(batch_id: str) -> Call[list[dict[str, Any]]]:
    return Call("GET", f"{_batch_path(batch_id)}/outputs", _output_files_answer)


def batch_output(batch_id: str, name: str) -> Call[None]:
    """The download of one output file (its answer is streamed, not parsed)."""
    path = f"{_batch_path(batch_id)}/outputs/{quote(name, safe='')}"
    return Call("GET", path, raise_for_error)


# ----------------------------------------------------------------------------- uploads


def _upload_path(upload_id: str) -> str:
    return f"/v2/uploads/{quote(upload_id, safe='')}"


def upload(source: UploadSource, name: str) -> Call[dict[str, Any]]:
    """Send a local file. No refusal is retried (each try would send the whole file again;
    waiting seconds does not free a tenant's stored bytes), nor a body that was (partly)
    sent and got no answer: only a connection that could not be made."""

    def answer(response: httpx.Response) -> dict[str, Any]:
        return checked_upload(json_answer(response), source)

    return Call(
        "POST",
        f"/v2/uploads?name={quote(name, safe='')}",
        answer,
        upload_headers(source),
        retry_statuses=frozenset(),
        resend_after_sent=False,
        upload=source,
    )


def uploads() -> Call[list[dict[str, Any]]]:
    return Call("GET", "/v2/uploads", _uploads_answer)


def upload_info(upload_id: str) -> Call[dict[str, Any]]:
    return Call("GET", _upload_path(upload_id), json_answer)


def delete_upload(upload_id: str) -> Call[None]:
    return Call("DELETE", _upload_path(upload_id), raise_for_error)


# ----------------------------------------------------------------------- waiting for batches

BATCH_FINISHED = frozenset({"completed", "failed", "cancelled"})


def batch_finished(state: Mapping[str, Any]) -> bool:
    return state.get("status") in BATCH_FINISHED


def batch_wait_expired(batch_id: str, state: Mapping[str, Any], timeout_s: float) -> JobNotFinished:
    return JobNotFinished(
        f"batch '{batch_id}' did not finish within {timeout_s:g} s "
        f"(status: {state.get('status', '?')}, rows {state.get('rows_done', 0)} of "
        f"{state.get('rows_total', 0)})",
        state,
    )


def completed_batch(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` when the batch completed; :class:`BatchFailed` with its reason otherwise."""
    if state.get("status") == "completed":
        return state
    reason = state.get("error") or "; ".join(
        f"shard {error.get('shard')}: {error.get('error')}"
        for error in state.get("errors", [])
        if isinstance(error, dict)
    )
    raise BatchFailed(
        f"batch '{state.get('id', '?')}' {state.get('status', 'ended')}"
        + (f": {reason}" if reason else ""),
        state,
    )


# ------------------------------------------------------------------------ waiting for jobs


class JobWait:
    """The pacing of waiting for a job: each result request asks the server to hold it
    until the job finishes (``Prefer: wait``, at most :data:`MAX_JOB_WAIT_S` and what is
    left of ``timeout_s``); when the server answers sooner (its own limit is lower), the
    next request comes after a pause instead of at once."""

    def __init__(self, timeout_s: float, pause_s: float = 1.0) -> None:
        self.timeout_s = timeout_s
        self.deadline = time.monotonic() + max(0.0, timeout_s)
        self.pause_s = pause_s
        self._asked_s = 0
        self._sent = 0.0

    def next_wait_s(self) -> int:
        """The ``Prefer: wait`` of the next result request (sent right after)."""
        remaining = self.deadline - time.monotonic()
        self._asked_s = min(MAX_JOB_WAIT_S, max(0, math.ceil(remaining)))
        self._sent = time.monotonic()
        return self._asked_s

    def after_not_finished(self, error: JobNotFinished) -> float:
        """Seconds to pause before the next result request; raises ``error`` (reworded)
        once the deadline has passed."""
        now = time.monotonic()
        if now >= self.deadline:
            raise JobNotFinished(
                f"job '{error.job.get('id', '?')}' did not finish within {self.timeout_s:g} s "
                f"(status: {error.job.get('status', '?')})",
                error.job,
            ) from error
        held_s = now - self._sent
        if held_s >= self._asked_s - 0.5:
            return 0.0
        return min(self.pause_s, self.deadline - now)
