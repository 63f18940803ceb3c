"""The blocking client (:class:`Client`); :mod:`sluice.client.async_client` is its twin."""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

import httpx
import numpy as np
import numpy.typing as npt

from sluice.client import calls, transfers
from sluice.client.calls import Call, Job, RetryPolicy
from sluice.client.codec import encode_json_request, encode_request
from sluice.client.errors import JobNotFinished, ServerUnreachable
from sluice.client.transfers import ProgressCallback

T = TypeVar("T")


class Client:
    """A Sluice (KServe v2 / Triton HTTP) server, over one pooled HTTP connection.

    ``url``: the gateway (default: ``SLUICE_URL``, else ``http://127.0.0.1:8000``);
    ``api_key``: default ``SLUICE_API_KEY``, as the ``sluice`` commands read them.
    ``binary``: tensors travel as raw bytes (Triton's binary tensor extension) rather than
    JSON lists. ``retries``: how many times a call answered 429 or 503, or that lost its
    connection, is sent again. Errors raise the server's exception class
    (:mod:`sluice.core.errors`) with its message.
    """

    def __init__(
        self,
        url: str | None = None,
        *,
        api_key: str | None = None,
        timeout_s: float = 60.0,
        retries: int = 5,
        binary: bool = True,
    ) -> None:
        if retries < 0:
            raise ValueError("retries must be 0 or more")
        self.url = calls.gateway_url(url)
        api_key = calls.api_key_of(api_key)
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
                    content=call.content
                    if call.upload is None
                    else transfers.read_chunks(call.upload),
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
        self,
        model: str,
        input: str,
        output: str | None = None,
        *,
        version: int | None = None,
        **options: Any,
    ) -> dict[str, Any]:
        """Start a batch job reading ``input`` (``upload:<id>``, or a location the operator
        allows) and writing ``output`` (None: the server's store, under the batch's id, to
        download with :meth:`download_batch_outputs`); the batch (``id``)."""
        return self._run(calls.submit_batch(model, input, output, version, options))

    def batch(self, batch_id: str) -> dict[str, Any]:
        return self._run(calls.batch(batch_id))

    def cancel_batch(self, batch_id: str) -> dict[str, Any]:
        return self._run(calls.cancel_batch(batch_id))

    def resume_batch(self, batch_id: str) -> dict[str, Any]:
        return self._run(calls.resume_batch(batch_id))

    def batches(self) -> list[dict[str, Any]]:
        return self._run(calls.batches())

    def delete_batch(self, batch_id: str) -> None:
        """Delete a batch job that has ended, with its outputs in the server's store (their
        bytes go back to the tenant's quota); :class:`Conflict` while it runs (cancel it
        first), :class:`NotFound` for an unknown one, or another tenant's."""
        self._run(calls.delete_batch(batch_id))

    def wait_batch(
        self, batch_id: str, *, timeout_s: float | None = None, poll_s: float = 1.0
    ) -> dict[str, Any]:
        """The batch's status once it has finished (completed, failed or cancelled);
        :class:`JobNotFinished` after ``timeout_s`` (None: no limit)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            state = self.batch(batch_id)
            if calls.batch_finished(state):
                return state
            if deadline is not None and time.monotonic() >= deadline:
                raise calls.batch_wait_expired(batch_id, state, timeout_s or 0.0)
            time.sleep(poll_s)

    def batch_outputs(self, batch_id: str) -> list[dict[str, Any]]:
        """The output files of a batch that ended kept in the server's store: all of a
        completed one's, or the parts of the shards a failed or cancelled one committed
        (each with the ``rows`` ``[start, end)`` it holds); each a ``name`` and its
        ``bytes`` (and ``sha256`` where the server gives it). :class:`Conflict` while it
        runs."""
        return self._run(calls.batch_outputs(batch_id))

    def download_batch_output(
        self,
        batch_id: str,
        name: str,
        path: str | os.PathLike[str],
        *,
        progress: ProgressCallback | None = None,
        size: int | None = None,
        sha256: str | None = None,
    ) -> Path:
        """Stream the output file ``name`` to ``path`` (the file itself), written under a
        temporary name and renamed once whole and checked against ``size`` and ``sha256``
        when given; the path."""
        call = calls.batch_output(batch_id, name)
        target = transfers.PartialFile(Path(path), size, sha256)
        attempt = 0
        while True:
            try:
                with self._http.stream(call.method, call.path, timeout=self.timeout_s) as response:
                    if response.status_code < 400:
                        return self._save(response, target, progress)
                    response.read()
            except httpx.TransportError as exc:
                target.discard()
                delay = self.retry.after_error(call, attempt, exc)
                if delay is None:
                    raise calls.transport_failure(self.url, exc) from exc
            except BaseException:
                target.discard()
                raise
            else:
                delay = self.retry.after_response(call, attempt, response)
                if delay is None:
                    raise calls.answer_error(response)
            time.sleep(delay)
            attempt += 1

    @staticmethod
    def _save(
        response: httpx.Response, target: transfers.PartialFile, progress: ProgressCallback | None
    ) -> Path:
        total = target.size if target.size is not None else transfers.content_length(response)
        target.open()
        if progress is not None:
            progress(0, total)
        for chunk in response.iter_bytes(transfers.CHUNK_BYTES):
            target.write(chunk)
            if progress is not None:
                progress(target.written, total)
        return target.commit()

    def download_batch_outputs(
        self,
        batch_id: str,
        directory: str | os.PathLike[str],
        *,
        progress: ProgressCallback | None = None,
    ) -> list[Path]:
        """Every output file of a batch that ended (see :meth:`batch_outputs`: of a failed
        or cancelled one, only the parts it committed) into ``directory`` (created), under
        the names the server lists; ``progress`` sees the bytes of all of them together."""
        folder = transfers.output_directory(directory)
        files = self.batch_outputs(batch_id)
        combined = transfers.CombinedProgress(files, progress)
        combined.start()
        saved = []
        for item in files:
            path = self.download_batch_output(
                batch_id,
                item["name"],
                transfers.output_path(folder, item["name"]),
                progress=combined.for_file(),
                size=item.get("bytes"),
                sha256=item.get("sha256"),
            )
            combined.file_done(path)
            saved.append(path)
        return saved

    def run_batch(
        self,
        model: str,
        input_path: str | os.PathLike[str],
        output_dir: str | os.PathLike[str],
        *,
        version: int | None = None,
        timeout_s: float | None = None,
        poll_s: float = 1.0,
        **options: Any,
    ) -> dict[str, Any]:
        """Upload a local file, run it through ``model`` as a batch job, wait for it, and
        download its outputs into ``output_dir``; the batch's final status.
        :class:`BatchFailed` (with the reason) when it does not complete. Both paths are
        checked before anything is sent."""
        source = transfers.input_file(input_path)
        folder = transfers.output_directory(output_dir)
        record = self.upload(source)
        submitted = self.submit_batch(
            model, transfers.UPLOAD_PREFIX + record["id"], version=version, **options
        )
        state = calls.completed_batch(
            self.wait_batch(submitted["id"], timeout_s=timeout_s, poll_s=poll_s)
        )
        self.download_batch_outputs(state["id"], folder)
        return state

    # ---------------------------------------------------------------------------- uploads

    def upload(
        self,
        path: str | os.PathLike[str],
        *,
        name: str | None = None,
        progress: ProgressCallback | None = None,
        hashing_progress: ProgressCallback | None = None,
    ) -> dict[str, Any]:
        """Upload a local file for batch jobs (``input: "upload:<id>"``), streamed from
        disk with its sha256 (computed first, in a pass of its own: ``hashing_progress``);
        the server's record: ``id``, ``name``, ``bytes``, ``sha256``, ``expires``.
        ``name`` (default: the file's) tells the server the format by its extension."""
        file = transfers.input_file(path)
        hashed = transfers.hash_file(file, hashing_progress)
        source = transfers.UploadSource(file, hashed.size, hashed.sha256, progress)
        return self._run(calls.upload(source, name or transfers.upload_name(file)))

    def uploads(self) -> list[dict[str, Any]]:
        """This API key's tenant's uploads."""
        return self._run(calls.uploads())

    def upload_info(self, upload_id: str) -> dict[str, Any]:
        return self._run(calls.upload_info(upload_id))

    def delete_upload(self, upload_id: str) -> None:
        self._run(calls.delete_upload(upload_id))
