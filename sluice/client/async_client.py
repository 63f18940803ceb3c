"""The asyncio client (:class:`AsyncClient`): :class:`~sluice.client.Client`'s calls,
awaited."""

from __future__ import annotations

import asyncio
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


class AsyncClient:
    """A Sluice (KServe v2 / Triton HTTP) server, from asyncio code; see
    :class:`~sluice.client.Client` for the options. Use ``async with`` or :meth:`aclose`."""

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
        self._http = httpx.AsyncClient(
            base_url=self.url, headers=calls.client_headers(api_key), timeout=timeout_s
        )

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def _send(self, call: Call[Any]) -> httpx.Response:
        attempt = 0
        while True:
            try:
                response = await self._http.request(
                    call.method,
                    call.path,
                    headers=call.headers,
                    content=call.content
                    if call.upload is None
                    else transfers.aread_chunks(call.upload),
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
            await asyncio.sleep(delay)
            attempt += 1

    async def _run(self, call: Call[T]) -> T:
        return call.parse(await self._send(call))

    # ------------------------------------------------------------------ server and models

    async def ready(self) -> bool:
        """Whether the server is ready to serve (False too when it cannot be reached)."""
        try:
            return await self._run(calls.ready())
        except ServerUnreachable:
            return False

    async def model_metadata(self, model: str, version: int | None = None) -> dict[str, Any]:
        return await self._run(calls.model_metadata(model, version))

    # ----------------------------------------------------------------------------- infer

    async def infer(
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
        return await self._run(calls.infer(model, body, version))

    async def infer_json(
        self, model: str, request: Mapping[str, Any], *, version: int | None = None
    ) -> dict[str, np.ndarray]:
        """Send a whole KServe v2 JSON request as it is; its outputs."""
        return await self._run(calls.infer(model, encode_json_request(request), version))

    # ------------------------------------------------------------------------------ jobs

    async def submit_job(
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
        return await self._run(calls.submit_job(model, body, version, idempotency_key))

    async def submit_job_json(
        self,
        model: str,
        request: Mapping[str, Any],
        *,
        version: int | None = None,
        idempotency_key: str | None = None,
    ) -> Job:
        """Queue a whole KServe v2 JSON request, as it is, as a job."""
        body = encode_json_request(request)
        return await self._run(calls.submit_job(model, body, version, idempotency_key))

    async def job(self, job_id: str | Job) -> dict[str, Any]:
        """The job's status and timestamps."""
        return await self._run(calls.job(calls.job_id_of(job_id)))

    async def job_result(self, job_id: str | Job, *, wait_s: float = 30.0) -> dict[str, np.ndarray]:
        """The job's outputs, waiting up to ``wait_s`` for it to finish (see
        :meth:`~sluice.client.Client.job_result`)."""
        return await self._run(calls.job_result(calls.job_id_of(job_id), wait_s))

    async def wait_job(
        self, job_id: str | Job, *, timeout_s: float = 300.0
    ) -> dict[str, np.ndarray]:
        """The job's outputs once it finishes; :class:`JobNotFinished` after ``timeout_s``."""
        waiting = calls.JobWait(timeout_s)
        while True:
            try:
                return await self.job_result(job_id, wait_s=waiting.next_wait_s())
            except JobNotFinished as exc:
                await asyncio.sleep(waiting.after_not_finished(exc))

    async def cancel_job(self, job_id: str | Job) -> dict[str, Any]:
        """Cancel the job; its status afterwards (``cancelling`` while a worker holds it)."""
        return await self._run(calls.cancel_job(calls.job_id_of(job_id)))

    # --------------------------------------------------------------------------- batches

    async def submit_batch(
        self,
        model: str,
        input: str,
        output: str | None = None,
        *,
        version: int | None = None,
        **options: Any,
    ) -> dict[str, Any]:
        """Start a batch job reading ``input`` and writing ``output``; the batch (``id``)."""
        return await self._run(calls.submit_batch(model, input, output, version, options))

    async def batch(self, batch_id: str) -> dict[str, Any]:
        return await self._run(calls.batch(batch_id))

    async def cancel_batch(self, batch_id: str) -> dict[str, Any]:
        return await self._run(calls.cancel_batch(batch_id))

    async def resume_batch(self, batch_id: str) -> dict[str, Any]:
        return await self._run(calls.resume_batch(batch_id))

    async def batches(self) -> list[dict[str, Any]]:
        return await self._run(calls.batches())

    async def delete_batch(self, batch_id: str) -> None:
        """Delete a batch job that has ended, with its outputs (see
        :meth:`~sluice.client.Client.delete_batch`)."""
        await self._run(calls.delete_batch(batch_id))

    async def wait_batch(
        self, batch_id: str, *, timeout_s: float | None = None, poll_s: float = 1.0
    ) -> dict[str, Any]:
        """The batch's status once it has finished (see
        :meth:`~sluice.client.Client.wait_batch`)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            state = await self.batch(batch_id)
            if calls.batch_finished(state):
                return state
            if deadline is not None and time.monotonic() >= deadline:
                raise calls.batch_wait_expired(batch_id, state, timeout_s or 0.0)
            await asyncio.sleep(poll_s)

    async def batch_outputs(self, batch_id: str) -> list[dict[str, Any]]:
        """The output files of a batch that ended kept in the server's store (see
        :meth:`~sluice.client.Client.batch_outputs`)."""
        return await self._run(calls.batch_outputs(batch_id))

    async def download_batch_output(
        self,
        batch_id: str,
        name: str,
        path: str | os.PathLike[str],
        *,
        progress: ProgressCallback | None = None,
        size: int | None = None,
        sha256: str | None = None,
    ) -> Path:
        """Stream the output file ``name`` to ``path`` (see
        :meth:`~sluice.client.Client.download_batch_output`); file I/O in worker threads."""
        call = calls.batch_output(batch_id, name)
        target = transfers.PartialFile(Path(path), size, sha256)
        attempt = 0
        while True:
            try:
                async with self._http.stream(
                    call.method, call.path, timeout=self.timeout_s
                ) as response:
                    if response.status_code < 400:
                        return await self._save(response, target, progress)
                    await response.aread()
            except httpx.TransportError as exc:
                await asyncio.to_thread(target.discard)
                delay = self.retry.after_error(call, attempt, exc)
                if delay is None:
                    raise calls.transport_failure(self.url, exc) from exc
            except BaseException:
                await asyncio.shield(asyncio.to_thread(target.discard))
                raise
            else:
                delay = self.retry.after_response(call, attempt, response)
                if delay is None:
                    raise calls.answer_error(response)
            await asyncio.sleep(delay)
            attempt += 1

    @staticmethod
    async def _save(
        response: httpx.Response, target: transfers.PartialFile, progress: ProgressCallback | None
    ) -> Path:
        total = target.size if target.size is not None else transfers.content_length(response)
        await asyncio.to_thread(target.open)
        if progress is not None:
            progress(0, total)
        async for chunk in response.aiter_bytes(transfers.CHUNK_BYTES):
            await asyncio.to_thread(target.write, chunk)
            if progress is not None:
                progress(target.written, total)
        return await asyncio.to_thread(target.commit)

    async def download_batch_outputs(
        self,
        batch_id: str,
        directory: str | os.PathLike[str],
        *,
        progress: ProgressCallback | None = None,
    ) -> list[Path]:
        """Every output file of a batch that ended into ``directory`` (created; see
        :meth:`~sluice.client.Client.download_batch_outputs`)."""
        folder = await asyncio.to_thread(transfers.output_directory, directory)
        files = await self.batch_outputs(batch_id)
        combined = transfers.CombinedProgress(files, progress)
        combined.start()
        saved = []
        for item in files:
            path = await self.download_batch_output(
                batch_id,
                item["name"],
                transfers.output_path(folder, item["name"]),
                progress=combined.for_file(),
                size=item.get("bytes"),
                sha256=item.get("sha256"),
            )
            await asyncio.to_thread(combined.file_done, path)
            saved.append(path)
        return saved

    async def run_batch(
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
        """Upload, run, wait, download (see :meth:`~sluice.client.Client.run_batch`)."""
        source = await asyncio.to_thread(transfers.input_file, input_path)
        folder = await asyncio.to_thread(transfers.output_directory, output_dir)
        record = await self.upload(source)
        submitted = await self.submit_batch(
            model, transfers.UPLOAD_PREFIX + record["id"], version=version, **options
        )
        finished = await self.wait_batch(submitted["id"], timeout_s=timeout_s, poll_s=poll_s)
        state = calls.completed_batch(finished)
        await self.download_batch_outputs(state["id"], folder)
        return state

    # ---------------------------------------------------------------------------- uploads

    async def upload(
        self,
        path: str | os.PathLike[str],
        *,
        name: str | None = None,
        progress: ProgressCallback | None = None,
        hashing_progress: ProgressCallback | None = None,
    ) -> dict[str, Any]:
        """Upload a local file for batch jobs (see :meth:`~sluice.client.Client.upload`);
        the file is hashed and read in worker threads (``hashing_progress`` is called
        from one)."""
        file = await asyncio.to_thread(transfers.input_file, path)
        hashed = await asyncio.to_thread(transfers.hash_file, file, hashing_progress)
        source = transfers.UploadSource(file, hashed.size, hashed.sha256, progress)
        return await self._run(calls.upload(source, name or transfers.upload_name(file)))

    async def uploads(self) -> list[dict[str, Any]]:
        """This API key's tenant's uploads."""
        return await self._run(calls.uploads())

    async def upload_info(self, upload_id: str) -> dict[str, Any]:
        return await self._run(calls.upload_info(upload_id))

    async def delete_upload(self, upload_id: str) -> None:
        await self._run(calls.delete_upload(upload_id))
