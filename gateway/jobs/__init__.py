"""Asynchronous jobs, offline batch jobs and the uploads they read, over HTTP."""
