"""The Celery application of a deployment's batch jobs, as both its sides configure it:
the gateway sends tasks by name, batch workers register and run them (:mod:`batch`).

Broker: the deployment's Redis, every key under ``Keys.celery_prefix`` and the queue named
after the namespace, so deployments sharing one Redis never see each other's tasks. No
result backend: batch progress and completion are kept in the batch's own Redis record.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sluice.core.batch_jobs.batches import QUEUE
from sluice.core.keys import Keys
from sluice.core.redis_client.connect import is_cluster_url

if TYPE_CHECKING:
    from celery import Celery


def broker_url(redis_url: str, batch_broker_url: str) -> str:
    """The broker batch tasks travel through: ``SLUICE_BATCH_BROKER_URL``, else the
    deployment's Redis unless that is a cluster, which Celery's Redis transport cannot use
    (ValueError, naming the setting)."""
    if batch_broker_url:
        return batch_broker_url
    if is_cluster_url(redis_url):
        raise ValueError(
            "batch jobs on a Redis Cluster need SLUICE_BATCH_BROKER_URL: a plain Redis for "
            "Celery, whose Redis transport does not speak Redis Cluster"
        )
    return redis_url


def queue_name(namespace: str) -> str:
    return f"{namespace}-{QUEUE}"


def celery_app(
    redis_url: str,
    namespace: str,
    *,
    visibility_timeout_s: float = 300.0,
    task_time_limit_s: float = 3600.0,
) -> Celery:
    from celery import Celery  # the batch extra; imported only where batches are used

    app = Celery("sluice", broker=redis_url, set_as_current=False)
    app.conf.update(
        broker_transport_options={
            "global_keyprefix": Keys(namespace).celery_prefix,
            "visibility_timeout": visibility_timeout_s,
            # Look for messages of lost workers often enough to honour the timeout (kombu
            # looks every 10 s and scans only every 10th time by default: 100 s).
            "unacked_restore_interval": max(1.0, min(10.0, visibility_timeout_s / 2)),
            "unacked_restore_throttle": 1,
        },
        broker_connection_retry_on_startup=True,
        task_default_queue=queue_name(namespace),
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        task_acks_on_failure_or_timeout=True,
        worker_prefetch_multiplier=1,
        task_time_limit=task_time_limit_s,
        task_ignore_result=True,
        task_serializer="json",
        accept_content=["json"],
        worker_hijack_root_logger=False,
        worker_send_task_events=False,
    )
    return app
