"""The protocol extensions the server metadata names (REST ``GET /v2``, gRPC
``ServerMetadata``)."""

from __future__ import annotations

EXTENSIONS = [
    "classification",
    "binary_tensor_data",
    "model_configuration",
    "statistics",
    "schedule_policy",
    "system_shared_memory",
    "cuda_shared_memory",
    "logging",
    "trace",
]
