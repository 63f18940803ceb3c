"""Triton's generated protocol modules (``grpc_service.proto``, ``model_config.proto``), as
the ``tritonclient`` wheel ships them: the server and Triton's clients use the very same
definitions."""

from __future__ import annotations

from tritonclient.grpc import model_config_pb2, service_pb2

SERVICE = "inference.GRPCInferenceService"

__all__ = ["SERVICE", "model_config_pb2", "service_pb2"]
