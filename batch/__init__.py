"""Offline batch jobs: the Celery tasks that plan a job, feed its shards to the model's
background stream and write the outputs (see :mod:`sluice.core.batch_jobs.batches`)."""
