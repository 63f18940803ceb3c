"""A batch worker's background rounds (finding lost shards, removing what expired)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from redis.exceptions import RedisError

log = logging.getLogger("batch")


class Periodic:
    """Runs ``action`` every ``every_s`` seconds on a daemon thread of its own until
    stopped. A round that fails is logged (a Redis error as a warning: Redis comes back)
    and the next one goes on."""

    def __init__(self, name: str, every_s: float, action: Callable[[], object], what: str):
        self.every_s, self.action, self.what = every_s, action, what
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                self.action()
            except RedisError as exc:
                log.warning("%s failed: %s", self.what, exc)
            except Exception:
                log.exception("%s failed", self.what)
