"""The protocol extensions the server metadata names (REST ``GET /v2``, gRPC
``ServerMetadata``): Triton's list, in Triton's order (core ``InferenceServer``), as Sluice
serves every one of them."""

from __future__ import annotations

EXTENSIONS = [
    "classification",
    "sequence",
    "model_repository",
    "model_repository(unload_dependents)",
    "schedule_policy",
    "model_configuration",
    "system_shared_memory",
    "cuda_shared_memory",
    "binary_tensor_data",
    "parameters",
    "statistics",
    "trace",
    "logging",
]
