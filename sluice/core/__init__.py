"""Sluice's core: what every service agrees on, and nothing that runs one.

Model configuration and repository reading, protocol types and tensor codecs, the Redis
layout and stream entries, settings, errors, tenants. The services (``sluice.gateway``,
``sluice.workers``, ``sluice.scheduler``, ``sluice.batch``) import from here and never from
each other; nothing here imports a service (the import contracts in ``pyproject.toml``).
"""
