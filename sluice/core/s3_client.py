"""The boto3 S3 client every Sluice process builds the same way: the deployment's endpoint
(path-style addressing for MinIO and other S3-compatible stores), region, timeouts and
retries. Credentials come from boto3's standard chain (``AWS_ACCESS_KEY_ID`` ..., a
profile, a role), so each process (controller, workers, gateway, batch worker) may be
given its own."""

from __future__ import annotations

from typing import Any

from sluice.core.errors import InvalidInput
from sluice.core.settings import RepositorySourceSettings


def s3_client(settings: RepositorySourceSettings) -> Any:
    """A new client, on a session of its own (boto3's default session is not thread-safe)."""
    try:
        import boto3
        from botocore.config import Config
    except ImportError:
        raise InvalidInput("s3:// locations need boto3: pip install 'sluice[s3]'") from None
    options: dict[str, Any] = {
        "connect_timeout": settings.s3_timeout_s,
        "read_timeout": settings.s3_timeout_s,
        "retries": {"total_max_attempts": settings.s3_attempts, "mode": "standard"},
    }
    if settings.s3_region:
        options["region_name"] = settings.s3_region
    if settings.s3_endpoint_url:
        options["s3"] = {"addressing_style": "path"}  # what MinIO and most others expect
    return boto3.session.Session().client(
        "s3", endpoint_url=settings.s3_endpoint_url or None, config=Config(**options)
    )
