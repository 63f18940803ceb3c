"""Offline batch jobs: their records, the uploads they read, where their data lives and
who may name it, the Celery application, and the sweep of what expired."""
