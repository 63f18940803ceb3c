"""The controller as a thread of ``sluice up``: it contends for the lease like any other, so
a ``sluice controller`` elsewhere may lead instead, or stand by."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from sluice.core.errors import StartupFailed
from sluice.core.settings import ControllerSettings, RepositorySourceSettings, UpSettings
from sluice.scheduler.controller.service import run
from sluice.scheduler.executor.kubernetes import start_executor

log = logging.getLogger("sluice.up")

JOIN_S = 10.0


def start_controller(settings: UpSettings, redis_url: str) -> Callable[[], None]:
    """Start the controller thread; what stops it (and waits a while for it)."""
    fields = {name: getattr(settings, name) for name in RepositorySourceSettings.model_fields}
    controller_settings = ControllerSettings(
        **fields,
        redis_url=redis_url,
        namespace=settings.namespace,
        model_repository=settings.model_repository,
    )
    stop = threading.Event()

    def lead_or_stand_by() -> None:
        try:
            run(controller_settings, stop, announce=False, start_executor=start_executor)
        except StartupFailed as exc:
            log.error("the controller cannot read the repository: %s", exc.message)

    thread = threading.Thread(target=lead_or_stand_by, name="controller", daemon=True)
    thread.start()

    def stop_controller() -> None:
        stop.set()
        thread.join(JOIN_S)

    return stop_controller
