"""An in-process gateway for tests of HTTP semantics without Redis: a :class:`Dispatcher`
double that answers every request itself, a control plane in memory, and the process state
and REST routes around them."""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterator
from typing import cast

from fastapi import FastAPI
from redis.asyncio import Redis

from sluice.core.catalog import CatalogEntry
from sluice.core.config.parse import parse_config_text
from sluice.core.dispatch import Reply
from sluice.core.errors import Unsupported
from sluice.core.keys import Keys
from sluice.core.settings import GatewaySettings
from sluice.core.wire import ReplyMessage, RequestMessage, TensorHeader
from sluice.gateway.admission import Admission
from sluice.gateway.body_budget import BodyBudget
from sluice.gateway.control.catalog_view import CatalogView
from sluice.gateway.http.errors import add_error_handlers
from sluice.gateway.http.fast_path import InferFastPath
from sluice.gateway.http.routes import router
from sluice.gateway.inference.request import RequestLimits
from sluice.gateway.shm.registry import RegionRegistry
from sluice.gateway.shm.transfer import TensorTransfer
from sluice.gateway.state import GatewayState
from tests.unit.gateway.memory_control_plane import MemoryControlPlane


class EchoDispatcher:
    """Answers each request at once: the i-th input comes back as the model's i-th output
    (an identity model), from the entry's own bytes. ``submitted`` keeps the messages."""

    def __init__(self, outputs: list[str], version: int = 1) -> None:
        self.outputs = outputs
        self.version = version
        self.expired: Counter[str] = Counter()
        self.cancelled: Counter[str] = Counter()
        self.submitted: list[RequestMessage] = []

    async def submit(
        self, model: str, stream: str, message: RequestMessage, payload: bytes, timeout_s: float
    ) -> Reply:
        self.submitted.append(message)
        outputs = [
            TensorHeader(name, header.datatype, header.shape, header.nbytes)
            for name, header in zip(self.outputs, message.inputs, strict=False)
        ]
        return ReplyMessage(message.request_key, self.version, outputs), memoryview(payload)

    def fail_all(self, error: Exception) -> None:
        pass

    def mirror(self, stream: str, message: RequestMessage, payload: bytes) -> None:
        pass

    def submit_stream(
        self, model: str, stream: str, message: RequestMessage, payload: bytes, timeout_s: float
    ) -> AsyncIterator[Reply]:
        raise Unsupported("the echo dispatcher answers no streams")


def in_process_gateway(
    model: str,
    config_text: str,
    dispatcher: EchoDispatcher,
    settings: GatewaySettings | None = None,
    control: MemoryControlPlane | None = None,
) -> InferFastPath:
    """The inference fast path over the REST routes, whose state serves one model (version
    ``dispatcher.version``, ready) through ``dispatcher`` and reads its control plane from
    ``control``; no Redis is reached."""
    settings = settings or GatewaySettings()
    config = parse_config_text(config_text, model_name=model)
    keys = Keys("unit")
    view = CatalogView(keys)
    view.models = {config.name: CatalogEntry(config.name, (dispatcher.version,), config)}
    view.ready = {config.name: frozenset((dispatcher.version,))}
    view.loaded = True
    regions = RegionRegistry.from_settings(settings)
    app = FastAPI()
    app.include_router(router)
    add_error_handlers(app)
    app.state.sluice = GatewayState(
        settings=settings,
        keys=keys,
        redis=cast(Redis, None),  # (jobs, uploads and batches are not served here)
        view=view,
        dispatcher=dispatcher,
        limits=RequestLimits(max_elements=settings.max_tensor_elements),
        admission=Admission(settings.max_in_flight),
        regions=regions,
        transfer=TensorTransfer.from_settings(settings, regions),
        bodies=BodyBudget(settings.max_body_bytes),
        control=control or MemoryControlPlane(),
        redis_ok=True,
    )
    return InferFastPath(app)
