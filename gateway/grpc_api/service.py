"""The gRPC service's calls other than inference: health, metadata, configuration,
statistics, repository, shared memory, trace and log settings.

Each renders what its REST route renders (:mod:`sluice.gateway.control.inspection` and the
route modules' shared functions) into the protobuf message Triton answers; errors are raised
as Sluice's errors and turned into gRPC statuses by the server
(:mod:`sluice.gateway.grpc_api.status`).
"""

from __future__ import annotations

from typing import Any

from google.protobuf import json_format

from sluice import __version__
from sluice.core.control import ControlCommand
from sluice.core.errors import InvalidInput, NotFound, Unsupported
from sluice.gateway.control.catalog_follow import asked_fresh, is_problem
from sluice.gateway.control.inspection import (
    config_document,
    metadata_document,
    model_not_ready,
    repository_rows,
    server_not_ready,
    stats_document,
    stats_targets,
)
from sluice.gateway.control.log_settings import change_log_settings, log_changes
from sluice.gateway.control.model_control import NAMED_REPOSITORY, carry_out, require_explicit
from sluice.gateway.control.server_extensions import EXTENSIONS
from sluice.gateway.control.trace_settings import refuse_changes, trace_settings
from sluice.gateway.shm.cuda import checked_raw_handle
from sluice.gateway.state import GatewayState

from .parameter_kinds import parameter_value
from .protocol import model_config_pb2, service_pb2

pb = service_pb2


def _version(value: str) -> str | None:
    return value or None


def _parsed(document: Any, message: Any) -> Any:
    return json_format.ParseDict(document, message, ignore_unknown_fields=True)


def _regions(rows: list[dict[str, Any]], message: Any) -> Any:
    """A shared memory status response: REST's list of regions as gRPC's map by name."""
    return _parsed({"regions": {row["name"]: row for row in rows}}, message)


class ControlCalls:
    """One method per RPC: the decoded request in, the response message out."""

    def __init__(self, state: GatewayState) -> None:
        self.state = state

    async def ServerLive(self, request: Any) -> Any:
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request: Any) -> Any:
        state = self.state
        problem = await asked_fresh(state, lambda: server_not_ready(state), is_problem)
        return pb.ServerReadyResponse(ready=problem is None)

    async def ModelReady(self, request: Any) -> Any:
        """Unknown or unready models are not ready (no error), as Triton answers."""
        state, version = self.state, _version(request.version)
        try:
            problem = await asked_fresh(
                state, lambda: model_not_ready(state, request.name, version), is_problem
            )
        except NotFound:
            return pb.ModelReadyResponse(ready=False)
        return pb.ModelReadyResponse(ready=problem is None)

    async def ServerMetadata(self, request: Any) -> Any:
        return pb.ServerMetadataResponse(name="sluice", version=__version__, extensions=EXTENSIONS)

    async def ModelMetadata(self, request: Any) -> Any:
        state, version = self.state, _version(request.version)
        document = await asked_fresh(state, lambda: metadata_document(state, request.name, version))
        return _parsed(document, pb.ModelMetadataResponse())

    async def ModelConfig(self, request: Any) -> Any:
        state, version = self.state, _version(request.version)
        document = await asked_fresh(state, lambda: config_document(state, request.name, version))
        config = _parsed(document, model_config_pb2.ModelConfig())
        return pb.ModelConfigResponse(config=config)

    async def ModelStatistics(self, request: Any) -> Any:
        state, version = self.state, _version(request.version)
        targets = await asked_fresh(state, lambda: stats_targets(state, request.name, version))
        return _parsed(await stats_document(state, targets), pb.ModelStatisticsResponse())

    async def RepositoryIndex(self, request: Any) -> Any:
        if request.repository_name:
            raise Unsupported(NAMED_REPOSITORY)
        rows = repository_rows(self.state, request.ready)
        return _parsed({"models": rows}, pb.RepositoryIndexResponse())

    async def RepositoryModelLoad(self, request: Any) -> Any:
        if request.repository_name:
            raise Unsupported(NAMED_REPOSITORY)
        await require_explicit(self.state)
        config: str | None = None
        files: dict[str, bytes] = {}
        for name, parameter in request.parameters.items():
            value = parameter_value(name, parameter)
            if name == "config":
                if not isinstance(value, str):
                    raise InvalidInput("'config' must be the model configuration as a JSON string")
                config = value
            elif name.startswith("file:"):
                if not isinstance(value, bytes):
                    raise InvalidInput(f"'{name}' must be the file's content (bytes_param)")
                files[name[len("file:") :]] = value
        await carry_out(self.state, ControlCommand("load", request.model_name, config, files))
        return pb.RepositoryModelLoadResponse()

    async def RepositoryModelUnload(self, request: Any) -> Any:
        if request.repository_name:
            raise Unsupported(NAMED_REPOSITORY)
        await require_explicit(self.state)
        parameter = request.parameters.get("unload_dependents")
        dependents = False if parameter is None else parameter_value("unload_dependents", parameter)
        if not isinstance(dependents, bool):
            raise InvalidInput("'unload_dependents' must be a boolean")
        command = ControlCommand("unload", request.model_name, dependents=dependents)
        await carry_out(self.state, command)
        return pb.RepositoryModelUnloadResponse()

    async def SystemSharedMemoryStatus(self, request: Any) -> Any:
        regions = await self.state.regions.system_status(request.name or None)
        return _regions(regions, pb.SystemSharedMemoryStatusResponse())

    async def SystemSharedMemoryRegister(self, request: Any) -> Any:
        if not request.key:
            raise InvalidInput(
                f"register region '{request.name}': 'key' must be a non-empty string"
            )
        await self.state.regions.register_system(
            request.name, request.key, request.offset, request.byte_size
        )
        return pb.SystemSharedMemoryRegisterResponse()

    async def SystemSharedMemoryUnregister(self, request: Any) -> Any:
        await self.state.regions.unregister_system(request.name or None)
        return pb.SystemSharedMemoryUnregisterResponse()

    async def CudaSharedMemoryStatus(self, request: Any) -> Any:
        regions = await self.state.regions.cuda_status(request.name or None)
        return _regions(regions, pb.CudaSharedMemoryStatusResponse())

    async def CudaSharedMemoryRegister(self, request: Any) -> Any:
        handle = checked_raw_handle(request.raw_handle)
        await self.state.regions.register_cuda(
            request.name, handle, request.device_id, request.byte_size
        )
        return pb.CudaSharedMemoryRegisterResponse()

    async def CudaSharedMemoryUnregister(self, request: Any) -> Any:
        await self.state.regions.unregister_cuda(request.name or None)
        return pb.CudaSharedMemoryUnregisterResponse()

    async def TraceSetting(self, request: Any) -> Any:
        state = self.state
        current = await asked_fresh(state, lambda: trace_settings(state, request.model_name))
        refuse_changes(dict(request.settings))
        response = pb.TraceSettingResponse()
        for key, values in current.items():
            response.settings[key].value.extend(values)
        return response

    async def LogSettings(self, request: Any) -> Any:
        document: dict[str, Any] = {}
        for key, setting in request.settings.items():
            which = setting.WhichOneof("parameter_choice")
            document[key] = getattr(setting, which) if which is not None else None
        changes = log_changes(document)
        settings = (await change_log_settings(self.state, changes)).as_triton()
        response = pb.LogSettingsResponse()
        for key, value in settings.items():
            entry = response.settings[key]
            if isinstance(value, bool):
                entry.bool_param = value
            elif isinstance(value, int):
                entry.uint32_param = value
            else:
                entry.string_param = str(value)
        return response
