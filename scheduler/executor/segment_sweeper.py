"""Shared memory segments left behind by killed children, removed while ``sluice up`` runs."""

from __future__ import annotations

import logging
import time

from sluice.core.repository import RepositoryModel
from sluice.core.settings import GatewaySettings
from sluice.core.shm import SEGMENT_GRACE_S, sweep_orphans

log = logging.getLogger("sluice.up")


class SegmentSweeper:
    """Removes the shared memory segments that killed children left in /dev/shm."""

    EVERY_S = 10.0

    def __init__(self, namespace: str, models: list[RepositoryModel]) -> None:
        self.namespace = namespace
        longest = GatewaySettings().default_timeout_s
        for model in models:
            dynamic = model.config.dynamic_batching if model.config is not None else None
            if dynamic is not None:
                longest = max(longest, dynamic.default_timeout_us / 1e6)
        self.max_age_s = 2 * longest  # an answer unread this long has no reader left
        self.due = 0.0

    def tick(self, *, final: bool = False) -> None:
        if final or time.monotonic() >= self.due:
            try:
                grace_s = 0.0 if final else SEGMENT_GRACE_S
                sweep_orphans(self.namespace, self.max_age_s, grace_s=grace_s)
            except OSError as exc:
                log.warning("sweeping shared memory segments failed: %s", exc)
            self.due = time.monotonic() + self.EVERY_S
