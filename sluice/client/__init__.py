"""Python client for Sluice (any KServe v2 / Triton HTTP server, mostly): inference with
numpy arrays, asynchronous jobs and batch jobs, blocking (:class:`Client`) or with asyncio
(:class:`AsyncClient`).

    from sluice.client import Client

    with Client("http://127.0.0.1:8000") as client:
        outputs = client.infer("iris", {"input": features})

Errors raise the server's own exception classes (:mod:`sluice.errors`), with its message.
"""

from __future__ import annotations

from sluice.client.async_client import AsyncClient
from sluice.client.calls import Job
from sluice.client.errors import JobCancelled, JobNotFinished, MalformedResponse, ServerUnreachable
from sluice.client.sync import Client
from sluice.errors import (
    DeadlineExceeded,
    Forbidden,
    InferenceFailed,
    InvalidInput,
    NotFound,
    Overloaded,
    PayloadTooLarge,
    SluiceError,
    Unauthorized,
    Unavailable,
    Unsupported,
)

__all__ = [
    "AsyncClient",
    "Client",
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
    "ServerUnreachable",
    "SluiceError",
    "Unauthorized",
    "Unavailable",
    "Unsupported",
]
