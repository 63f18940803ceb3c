"""The gateway's gRPC server: ``inference.GRPCInferenceService``, ``grpc.health.v1.Health``
and server reflection, on ``SLUICE_GRPC_PORT``, in the gateway's event loop and on its state.

Keys as for REST: metadata ``authorization: Bearer <key>``; the repository, shared memory,
trace and log calls are management calls (admin keys), the others inference calls; health
and reflection are open. Triton's restricted protocols (``SLUICE_GRPC_RESTRICTED_PROTOCOL``)
apply beside the keys; its ``health`` category covers the health checking protocol too.
TLS with the HTTP API's certificate when one is set. Health answers SERVING for the whole
server ("") and for the inference service while the server is ready
(:func:`sluice.gateway.control.inspection.server_not_ready`), re-checked at every catalog refresh.

Memory and streams are bounded before grpcio buffers anything a handler could refuse:
see :mod:`sluice.gateway.grpc_api.limits` (what may arrive at once) and
:mod:`sluice.gateway.grpc_api.options` (streams per connection, flow control, keepalive).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any, TypeAlias

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from sluice.core.errors import InvalidConfig, InvalidInput, PayloadTooLarge
from sluice.core.restricted_api import (
    GRPC_PREFIX,
    Restriction,
    denial,
    grpc_category,
    parse_restrictions,
)
from sluice.core.settings import GatewaySettings
from sluice.core.tenants import CURRENT_TENANT
from sluice.gateway.control.catalog_follow import follow_changes
from sluice.gateway.control.inspection import server_not_ready
from sluice.gateway.state import GatewayState
from sluice.gateway.tenants.keys import KeyRing, bearer_token

from .infer import InferCalls
from .limits import GrpcLimits
from .options import server_options
from .protocol import SERVICE, service_pb2
from .service import ControlCalls
from .status import status_of

log = logging.getLogger(__name__)

_MANAGEMENT = frozenset(
    (
        "RepositoryIndex",
        "RepositoryModelLoad",
        "RepositoryModelUnload",
        "SystemSharedMemoryStatus",
        "SystemSharedMemoryRegister",
        "SystemSharedMemoryUnregister",
        "CudaSharedMemoryStatus",
        "CudaSharedMemoryRegister",
        "CudaSharedMemoryUnregister",
        "TraceSetting",
        "LogSettings",
    )
)
_HEALTH = frozenset(("ServerLive", "ServerReady"))
_DENIED = {401: grpc.StatusCode.UNAUTHENTICATED, 403: grpc.StatusCode.PERMISSION_DENIED}
_COMPRESSION = {
    "none": grpc.Compression.NoCompression,
    "gzip": grpc.Compression.Gzip,
    "deflate": grpc.Compression.Deflate,
}

Context: TypeAlias = "grpc.aio.ServicerContext[Any, Any]"


class GrpcServer:
    """Started and stopped by the gateway's lifespan."""

    def __init__(self, state: GatewayState) -> None:
        self.state = state
        self.limits = GrpcLimits.from_settings(state.settings)
        self.keys = KeyRing.from_settings(state.settings)
        self.restricted = parse_restrictions(state.settings.grpc_restricted_protocol)
        """Triton's restricted protocols (:mod:`sluice.core.restricted_api`), by category."""
        self.health = health.aio.HealthServicer()
        self.server: grpc.aio.Server | None = None
        self._watcher: asyncio.Task[None] | None = None
        self._health_status: int | None = None
        """The status last given to the health service (set again only when it changes)."""

    async def start(self) -> None:
        settings = self.state.settings
        server = grpc.aio.server(
            options=server_options(settings, self.limits),
            maximum_concurrent_rpcs=settings.max_in_flight,
            compression=_COMPRESSION[settings.grpc_response_compression],
        )
        server.add_generic_rpc_handlers((self._inference_handler(),))
        health_pb2_grpc.add_HealthServicer_to_server(
            _RestrictedHealth(self.health, self.restricted), server
        )
        reflection.enable_server_reflection(
            (
                SERVICE,
                health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                reflection.SERVICE_NAME,
            ),
            server,
        )
        address = f"{_bracketed(settings.http_host)}:{settings.grpc_port}"
        try:
            credentials = _credentials(settings)
            if credentials is not None:
                server.add_secure_port(address, credentials)
            else:
                server.add_insecure_port(address)
        except RuntimeError as exc:
            raise InvalidConfig(f"cannot listen on {address} (gRPC port): {exc}") from None
        await server.start()
        self.server = server
        await self.refresh_health()
        self._watcher = asyncio.create_task(self._watch_health(), name="grpc-health")

    async def stop(self, grace_s: float) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
            await asyncio.gather(self._watcher, return_exceptions=True)
        if self.server is not None:
            await self.health.enter_graceful_shutdown()
            await self.server.stop(grace_s)

    async def refresh_health(self) -> None:
        ready = server_not_ready(self.state) is None
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if ready
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        if status == self._health_status:
            return
        for service in ("", SERVICE):
            await self.health.set(service, status)
        self._health_status = status

    async def _watch_health(self) -> None:
        """Readiness changes with the catalog refresh: the status follows each refresh."""
        refreshed = self.state.refreshed
        while True:
            await refreshed.wait()
            refreshed.clear()
            try:
                await self.refresh_health()
            except Exception:
                log.exception("updating the gRPC health status failed")

    # ----------------------------------------------------------------- handlers

    def _inference_handler(self) -> grpc.GenericRpcHandler:
        control = ControlCalls(self.state)
        infer = InferCalls(self.state, self.limits, self._infer_denied)
        handlers: dict[str, grpc.RpcMethodHandler] = {}
        methods = service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"].methods
        for method in methods:
            name = method.name
            if name == "ModelInfer":  # bytes in, bytes out: decoded and encoded off the loop
                # Client-streaming on the server's side (the same bytes on the wire): the
                # handler runs before the message is read, and reads it in turn. Its key is
                # checked by the handler itself, from the metadata it reads anyway.
                handlers[name] = grpc.stream_unary_rpc_method_handler(
                    self._restricted_infer(infer.model_infer)
                )
            elif name == "ModelStreamInfer":
                handlers[name] = grpc.stream_stream_rpc_method_handler(
                    self._guarded_stream(name, infer.model_stream_infer)
                )
            else:  # bytes in: the size is checked before anything is decoded
                request_type = getattr(service_pb2, method.input_type.name)
                call = _control_call(
                    getattr(control, name), request_type, self.state.settings.max_control_body_bytes
                )
                handlers[name] = grpc.unary_unary_rpc_method_handler(
                    self._guarded_unary(name, call), response_serializer=_serialize
                )
        return grpc.method_handlers_generic_handler(SERVICE, handlers)

    def _restricted_infer(
        self, call: Callable[[AsyncIterator[bytes], Context], Awaitable[bytes]]
    ) -> Callable[[AsyncIterator[bytes], Context], Awaitable[bytes]]:
        """ModelInfer within Triton's restricted ``inference`` protocol, checked before the
        message is read."""
        if "inference" not in self.restricted:
            return call

        async def restricted(messages: AsyncIterator[bytes], context: Context) -> bytes:
            await _refuse_restricted(self.restricted, "inference", context)
            return await call(messages, context)

        return restricted

    def _infer_denied(self, metadata: dict[str, str]) -> tuple[grpc.StatusCode, str] | None:
        """Why an inference call with ``metadata`` is refused for its key (None: it is
        not)."""
        keys = self.keys
        if not keys.configured:
            return None
        value = metadata.get("authorization")
        token = None if value is None else bearer_token(value.encode("latin-1"))
        access = keys.access_call(False, token)
        denied = access.denied
        if denied is None:
            CURRENT_TENANT.set(access.tenant)
            return None
        return _DENIED.get(denied[0], grpc.StatusCode.UNAUTHENTICATED), denied[1]

    async def _check_key(self, method: str, context: Context) -> None:
        await _refuse_restricted(self.restricted, grpc_category(method), context)
        if method in _HEALTH:
            return  # open, as HTTP's /v2/health/*
        token: bytes | None = None
        for key, value in context.invocation_metadata() or ():
            if key == "authorization":
                raw = value.encode("latin-1") if isinstance(value, str) else value
                token = bearer_token(raw)
                break
        access = self.keys.access_call(method in _MANAGEMENT, token)
        denied = access.denied
        if denied is not None:
            await context.abort(_DENIED.get(denied[0], grpc.StatusCode.UNAUTHENTICATED), denied[1])
        CURRENT_TENANT.set(access.tenant)

    def _guarded_unary(
        self, method: str, call: Callable[[Any, Context], Awaitable[Any]]
    ) -> Callable[[Any, Context], Awaitable[Any]]:
        state = self.state

        async def guarded(request: Any, context: Context) -> Any:
            await self._check_key(method, context)
            if state.host_changes.value() != state.host_seen:
                await follow_changes(state)
            return await call(request, context)

        return guarded

    def _guarded_stream(
        self, method: str, call: Callable[[AsyncIterator[Any], Context], AsyncIterator[Any]]
    ) -> Callable[[AsyncIterator[Any], Context], AsyncIterator[Any]]:
        async def guarded(requests: AsyncIterator[Any], context: Context) -> AsyncIterator[Any]:
            await self._check_key(method, context)
            async for response in call(requests, context):
                yield response

        return guarded


async def _refuse_restricted(
    restricted: Mapping[str, Restriction], category: str | None, context: Context
) -> None:
    """Abort the call, as Triton does (UNAVAILABLE), when ``category`` is restricted and the
    call's metadata lacks the agreed header."""
    if not restricted:
        return
    metadata = [
        (k, v if isinstance(v, str) else v.decode("latin-1"))
        for k, v in context.invocation_metadata() or ()
    ]
    refused = denial(restricted, category, metadata, GRPC_PREFIX)
    if refused is not None:
        await context.abort(grpc.StatusCode.UNAVAILABLE, refused)


class _RestrictedHealth:
    """``grpc.health.v1.Health`` in Triton's ``health`` category: Triton restricts its gRPC
    health checking protocol with ServerLive, ServerReady and ModelReady."""

    def __init__(self, servicer: Any, restricted: Mapping[str, Restriction]) -> None:
        self.servicer = servicer
        self.restricted = restricted

    async def Check(self, request: Any, context: Context) -> Any:
        await _refuse_restricted(self.restricted, "health", context)
        return await self.servicer.Check(request, context)

    async def Watch(self, request: Any, context: Context) -> Any:
        await _refuse_restricted(self.restricted, "health", context)
        return await self.servicer.Watch(request, context)


def _control_call(
    method: Callable[[Any], Awaitable[Any]], request_type: Any, limit: int
) -> Callable[[bytes, Context], Awaitable[Any]]:
    """A control RPC taking its request as bytes, at most ``limit`` of them (as REST's
    ``SLUICE_MAX_CONTROL_BODY_BYTES``), whose Sluice errors become gRPC statuses."""

    async def call(message: bytes, context: Context) -> Any:
        try:
            if len(message) > limit:
                raise PayloadTooLarge(
                    f"the request message has {len(message)} bytes, more than the limit of "
                    f"{limit} (SLUICE_MAX_CONTROL_BODY_BYTES)"
                )
            try:
                request = request_type.FromString(message)
            except DecodeError as exc:
                raise InvalidInput(f"malformed {request_type.__name__}: {exc}") from None
            return await method(request)
        except Exception as exc:
            code, details = status_of(exc)
            await context.abort(code, details)

    return call


def _serialize(message: Any) -> bytes:
    serialized: bytes = message.SerializeToString()
    return serialized


def _bracketed(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def _credentials(settings: GatewaySettings) -> grpc.ServerCredentials | None:
    """The gRPC port's TLS (None: plain): its own certificate (Triton's --grpc-use-ssl,
    --grpc-server-cert, --grpc-server-key) or the HTTP one, and with
    --grpc-use-ssl-mutual the authorities whose client certificates are required."""
    mutual = settings.grpc_use_ssl_mutual
    if settings.grpc_server_cert and (settings.grpc_use_ssl or mutual):
        names = "SLUICE_GRPC_SERVER_CERT / SLUICE_GRPC_SERVER_KEY"
        certfile, keyfile = settings.grpc_server_cert, settings.grpc_server_key
    elif settings.ssl_certfile:
        names = "SLUICE_SSL_CERTFILE / SLUICE_SSL_KEYFILE"
        certfile, keyfile = settings.ssl_certfile, settings.ssl_keyfile
    else:
        return None
    try:
        certificate = Path(certfile).read_bytes()
        key = Path(keyfile or certfile).read_bytes()
        roots = Path(settings.grpc_root_cert).read_bytes() if mutual else None
    except OSError as exc:
        what = f"{names} / SLUICE_GRPC_ROOT_CERT" if mutual else names
        raise InvalidConfig(f"{what}: {exc}") from None
    return grpc.ssl_server_credentials(
        ((key, certificate),), root_certificates=roots, require_client_auth=mutual
    )
