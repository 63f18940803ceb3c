"""The blocking client (:class:`Client`); :mod:`sluice.client.async_client` is its twin."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import Any, TypeVar

import httpx
import numpy as np
import numpy.typing as npt

from sluice.client import calls
from sluice.client.calls import Call, Job, RetryPolicy
from sluice.client.codec import encode_json_request, encode_request
from sluice.client.errors import JobNotFinished, ServerUnreachable

T = TypeVar("T")


class Client:
    """A Sluice (KServe v2 / Triton HTTP) server, over one pooled HTTP connection.

    ``binary``: tensors travel as raw bytes (Triton's binary tensor extension) rather than
    JSON lists. ``retries``: how many times a call answered 429 or 503, or that lost its
    connection, is sent again. Errors raise the server's exception class
    (:mod:`sluice.errors`) with its message.
    """

    def __init__(
        self,
        url: str = "http://127.0.0.1:8000",
        *,
        api_key: str | None = None,
        timeout_s: float = 60.0,
        retries: int = 5,
        binary: bool = True,
    ) -> None:
        if retries < 0:
            raise ValueError("retries must be 0 or more")
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self.binary = binary
        self.retry = RetryPolicy(retries)
        self._http = httpx.Client(
            base_url=self.url, headers=calls.client_headers(api_key), timeout=timeout_s
        )

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def _send(self, call: Call[Any]) -> httpx.Response:
        attempt = 0
        while True:
            try:
                response = self._http.request(
                    call.method,
                    call.path,
                    headers=call.headers,
                    content=call.content,
                    timeout=self.timeout_s + call.extra_timeout_s,
                )
            except httpx.TransportError as exc:
                delay = self.retry.after_error(call, attempt, exc)
                if delay is None:
                    raise calls.transport_failure(self.url, exc) from exc
            else:
                delay = self.retry.after_response(call, attempt, response)
                if delay is None:
                    return response
            time.sleep(delay)
            attempt += 1

    def _run(self, call: Call[T]) -> T:
        return call.parse(self._send(call))

    # ------------------------------------------------------------------ server and models

    def ready(self) -> bool:
        """Whether the server is ready to serve (False too when it cannot be reached)."""
        try:
            return self._run(calls.ready())
        except ServerUnreachable:
            return False

    def model_metadata(self, model: str, version: int | None = None) -> dict[str, Any]:
        return self._run(calls.model_metadata(model, version))

    # ----------------------------------------------------------------------------- infer

    def infer(
        self,
        model: str,
        inputs: Mapping[str, npt.ArrayLike],
        *,
        outputs: Sequence[str] | None = None,
        version: int | None = None,
        parameters: Mapping[str, Any] | None = None,
        request_id: str | None = None,
    ) -> dict[str, np.ndarray]:
        """The model's outputs (all of them, or those named) for ``inputs``."""
        body = encode_request(
            inputs,
            outputs=outputs,
            parameters=parameters,
            request_id=request_id,
            binary=self.binary,
        )
        return self._run(calls.infer(model, body, version))

    def infer_json(
        self, model: str, request: Mapping[str, Any], *, version: int | None = None
    ) -> dict[str, np.ndarray]:
        """Send a whole KServe v2 JSON request as it is; its outputs."""
        return self._run(calls.infer(model, encode_json_request(request), version))

    # ------------------------------------------------------------------------------ jobs

    def submit_job(
        self,
        model: str,
        inputs: Mapping[str, npt.ArrayLike],
        *,
        outputs: Sequence[str] | None = None,
        version: int | None = None,
        parameters: Mapping[str, Any] | None = None,
        request_id: str | None = None,
        idempotency_key: str | None = None,
    ) -> Job:
        """Queue the request as an asynchronous job. A repeated ``idempotency_key`` (or
        ``request_id``) returns the earlier job instead of a new one."""
        body = encode_request(
            inputs,
            outputs=outputs,
            parameters=parameters,
            request_id=request_id,
            binary=self.binary,
        )
        return self._run(calls.submit_job(model, body, version, idempotency_key))

    def submit_job_json(
        self,
        model: str,
        request: Mapping[str, Any],
        *,
        version: int | None = None,
        idempotency_key: str | None = None,
    ) -> Job:
        """Queue a whole KServe v2 JSON request, as it is, as a job."""
        body = encode_json_request(request)
        return self._run(calls.submit_job(model, body, version, idempotency_key))

    def job(self, job_id: str | Job) -> dict[str, Any]:
        """The job's status (``status``: queued, in_progress, completed, failed, expired,
        cancelling or cancelled) and timestamps."""
        return self._run(calls.job(calls.job_id_of(job_id)))

    def job_result(self, job_id: str | Job, *, wait_s: float = 30.0) -> dict[str, np.ndarray]:
        """The job's outputs, waiting up to ``wait_s`` for it to finish. Raises
        :class:`JobNotFinished` if it has not, :class:`JobCancelled` for a cancelled job,
        and the request's own error for a failed one."""
        return self._run(calls.job_result(calls.job_id_of(job_id), wait_s))

    def wait_job(self, job_id: str | Job, *, timeout_s: float = 300.0) -> dict[str, np.ndarray]:
        """The job's outputs once it finishes; :class:`JobNotFinished` after ``timeout_s``."""
        waiting = calls.JobWait(timeout_s)
        while True:
            try:
                return self.job_result(job_id, wait_s=waiting.next_wait_s())
            except JobNotFinished as exc:
                time.sleep(waiting.after_not_finished(exc))

    def cancel_job(self, job_id: str | Job) -> dict[str, Any]:
        """Cancel the job; its status afterwards (``cancelling`` while a worker holds it)."""
        return self._run(calls.cancel_job(calls.job_id_of(job_id)))

    # --------------------------------------------------------------------------- batches

    def submit_batch(
        self, model: str, input: str, output: str, *, version: int | None = None, **options: Any
    ) -> dict[str, Any]:
        """Start a batch job reading ``input`` and writing ``output``; the batch (``id``)."""
        return self._run(calls.submit_batch(model, input, output, version, options))

    def batch(self, batch_id: str) -> dict[str, Any]:
        return self._run(calls.batch(batch_id))

    def cancel_batch(self, batch_id: str) -> dict[str, Any]:
        return self._run(calls.cancel_batch(batch_id))

    def resume_batch(self, batch_id: str) -> dict[str, Any]:
        return self._run(calls.resume_batch(batch_id))

    def batches(self) -> list[dict[str, Any]]:
        return self._run(calls.batches())
