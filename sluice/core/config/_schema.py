"""Triton's ModelConfig protobuf schema, taken from the ``tritonclient`` wheel.

``tritonclient.grpc/__init__`` imports grpcio and tritonclient's whole gRPC client,
which the workers and the config reader have no use for, so the generated
``model_config_pb2`` file is loaded by path instead of by import. The generated
code registers its descriptors in the default pool, so loading it twice (here and
through ``tritonclient.grpc``) yields the same message classes.
"""

from __future__ import annotations

import functools
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

_MODULE_NAME = "sluice_model_config_pb2"


@functools.cache
def model_config_pb2() -> ModuleType:
    """The generated ``model_config_pb2`` module (loaded once)."""
    already = sys.modules.get("tritonclient.grpc.model_config_pb2")
    if already is not None:
        return already
    spec = importlib.util.find_spec("tritonclient")
    locations = spec.submodule_search_locations if spec is not None else None
    if not locations:
        raise ImportError("the tritonclient package is not installed")
    for location in locations:
        path = Path(location) / "grpc" / "model_config_pb2.py"
        if path.is_file():
            break
    else:
        raise ImportError("tritonclient does not ship grpc/model_config_pb2.py")
    file_spec = importlib.util.spec_from_file_location(_MODULE_NAME, path)
    if file_spec is None or file_spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(file_spec)
    file_spec.loader.exec_module(module)
    sys.modules[_MODULE_NAME] = module
    return module


def new_model_config() -> Any:
    """An empty ``inference.ModelConfig`` message."""
    return model_config_pb2().ModelConfig()
