"""The batch worker: a Celery worker on the deployment's Redis running the plan and shard
tasks (:mod:`sluice.batch.runner`).

Tasks are acknowledged late and rejected when their worker is lost (killed); one prefetched
message at a time. A running shard holds a lease it renews every second: when its worker
dies, every batch worker's reaper sees the lease run out and queues the shard again, to run
as a new attempt (:mod:`sluice.batch.runner`); the broker's own redelivery, after
``SLUICE_BATCH_VISIBILITY_TIMEOUT_S``, is the last resort. A transient failure (Redis, storage) is
retried by Celery with a back-off; after ``max_retries`` the shard counts as failed. Every
batch worker also removes expired uploads and batch jobs from the batch store
(:mod:`sluice.core.batch_jobs.sweeper`).

S3 credentials come from the standard AWS chain (``AWS_ACCESS_KEY_ID`` /
``AWS_SECRET_ACCESS_KEY``, ``AWS_PROFILE``, a role), read by this process alone: give the
batch worker credentials of its own, for the batch store and the locations batch jobs may
name, and none that can write the model repository.
"""

from __future__ import annotations

import logging
from typing import Any

from celery import Celery
from redis.exceptions import RedisError

from sluice.batch.periodic import Periodic
from sluice.batch.runner import Reaper, Runner
from sluice.core.batch_jobs import batches as b
from sluice.core.batch_jobs.celery_config import broker_url, celery_app, queue_name
from sluice.core.batch_jobs.sweeper import StoreSweeper
from sluice.core.settings import BatchSettings

log = logging.getLogger("batch")

_RETRY_BACKOFF_S = 2.0
_PLAN_RETRIES = 10
_PLAN_BACKOFF_MAX_S = 30.0
"""A plan is tried again after 2, 4, 8, 16 s, then every 30 s: about 4 minutes in all."""


def create_app(settings: BatchSettings) -> tuple[Celery, Runner]:
    app = celery_app(
        broker_url(settings.redis_url, settings.batch_broker_url),
        settings.namespace,
        visibility_timeout_s=settings.batch_visibility_timeout_s,
        task_time_limit_s=settings.batch_task_time_limit_s,
    )
    queue = queue_name(settings.namespace)

    def send_shard(batch_id: str, index: int) -> None:
        app.send_task(b.SHARD_TASK, args=[batch_id, index], queue=queue)

    def send_plan(batch_id: str) -> None:
        app.send_task(b.PLAN_TASK, args=[batch_id, True], queue=queue)

    runner = Runner(settings, send_shard, send_plan)

    # Celery's decorators are untyped; the tasks keep their own annotations.
    @app.task(name=b.PLAN_TASK, bind=True, max_retries=_PLAN_RETRIES)  # type: ignore[untyped-decorator]
    def plan(self: Any, batch_id: str, resume: bool = False) -> None:
        try:
            runner.plan(batch_id, resume)
        except (OSError, RedisError) as exc:
            # Redis or the store out of reach for a moment (a name that did not resolve,
            # a failover): planned again later, for minutes, so the job is not left planning.
            if self.request.retries >= self.max_retries:
                runner.give_up(batch_id, f"planning failed: {exc}")
                raise
            log.warning("batch %s: planning failed (%s); retrying", batch_id, exc)
            countdown = min(_RETRY_BACKOFF_S * 2**self.request.retries, _PLAN_BACKOFF_MAX_S)
            raise self.retry(exc=exc, countdown=countdown) from None
        except Exception as exc:
            # Nothing will plan it again (no lease, no reaper): failed, saying why, so that
            # it expires (and lets its upload go) rather than stays planning for good.
            runner.give_up(batch_id, f"planning failed: {exc}")
            raise

    @app.task(name=b.SHARD_TASK, bind=True, max_retries=3)  # type: ignore[untyped-decorator]
    def shard(self: Any, batch_id: str, index: int) -> None:
        tries_left = self.request.retries < self.max_retries
        try:
            runner.shard(batch_id, index, tries_left)
        except Exception as exc:
            if not tries_left:
                raise
            log.warning("batch %s shard %d: %s; retrying", batch_id, index, exc)
            raise self.retry(
                exc=exc, countdown=_RETRY_BACKOFF_S * 2**self.request.retries
            ) from None

    return app, runner


def run_worker(settings: BatchSettings) -> int:
    """A batch worker until SIGTERM / SIGINT (Celery's warm shutdown: the task in hand is
    finished, or given back when killed)."""
    app, runner = create_app(settings)
    logging.captureWarnings(True)  # Celery's warnings become log lines like every other
    log.info("batch worker on queue %s", queue_name(settings.namespace))
    lost = Reaper(runner)
    reaper = Periodic("shard-reaper", lost.every_s, lost.sweep, "looking for lost shards")
    reaper.start()
    store = StoreSweeper(runner.redis, runner.keys, runner.storage.store)
    sweeper = Periodic(
        "store-sweeper",
        settings.store_sweep_s,
        store.sweep_all,
        "removing expired uploads and batch jobs",
    )
    sweeper.start()
    try:
        app.worker_main(
            [
                "--quiet",  # no banner: every line the worker writes is a log line
                "worker",
                "--pool",
                "threads",
                "--concurrency",
                str(settings.batch_concurrency),
                "--queues",
                queue_name(settings.namespace),
                "--without-gossip",
                "--without-mingle",
                "--without-heartbeat",
                "--loglevel",
                "WARNING",
            ]
        )
    finally:
        sweeper.stop()
        reaper.stop()
        runner.close()
    return 0
