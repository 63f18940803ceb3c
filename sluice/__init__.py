"""Sluice: an inference server built around a durable Redis queue.

This package is the shared kernel: model configuration, repository reading,
protocol types and tensor codecs, the Redis key/entry schema, settings and
errors. It imports none of the services (``gateway``, ``workers``,
``scheduler``); only :mod:`sluice.cli`, the composition root, reaches them.
"""

__version__ = "0.1.0"
