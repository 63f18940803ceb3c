"""Python client for Sluice (any KServe v2 / Triton HTTP server, mostly): inference with
numpy arrays, asynchronous jobs and batch jobs, blocking (:class:`Client`) or with asyncio
(:class:`AsyncClient`).

    from sluice.client import Client

    with Client("http://127.0.0.1:8000") as client:
        outputs = client.infer("iris", {"input": features})
        client.run_batch("mlp", "rows.npy", "out/")  # upload, run, download

Errors raise the server's own exception classes (:mod:`sluice.core.errors`), with its message.
"""

from __future__ import annotations

from sluice.client.async_client import AsyncClient
from sluice.client.calls import Job
from sluice.client.errors import (
    BatchFailed,
    JobCancelled,
    JobNotFinished,
    MalformedResponse,
    ServerUnreachable,
)
from sluice.client.sync import Client
from sluice.core.errors import (
    Conflict,
    DeadlineExceeded,
    Forbidden,
    InferenceFailed,
    InvalidInput,
    NotFound,
    Overloaded,
    PayloadTooLarge,
    QuotaExceeded,
    SluiceError,
    Unauthorized,
    Unavailable,
    Unsupported,
)

__all__ = [
    "AsyncClient",
    "BatchFailed",
    "Client",
    "Conflict",
    "DeadlineExceeded",
    "Forbidden",
    "InferenceFailed",
    "InvalidInput",
    "Job",
    "JobCancelled",
    "JobNotFinished",
    "MalformedResponse",
    "NotFound",
    "Overloaded",
    "PayloadTooLarge",
    "QuotaExceeded",
    "ServerUnreachable",
    "SluiceError",
    "Unauthorized",
    "Unavailable",
    "Unsupported",
]
