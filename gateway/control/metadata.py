"""Model metadata in the KServe v2 layout."""

from __future__ import annotations

from typing import Any

from sluice.core.catalog import CatalogEntry
from sluice.core.config import ModelConfig, TensorSpec


def _tensor(spec: TensorSpec, config: ModelConfig) -> dict[str, Any]:
    shape = list(spec.dims)
    if config.max_batch_size > 0:
        shape.insert(0, -1)
    return {"name": spec.name, "datatype": spec.datatype, "shape": shape}


def model_metadata(entry: CatalogEntry, versions: list[int]) -> dict[str, Any]:
    config = entry.config
    assert config is not None
    return {
        "name": entry.name,
        "versions": [str(v) for v in versions],
        "platform": config.platform_or_backend,
        "inputs": [_tensor(spec, config) for spec in config.inputs],
        "outputs": [_tensor(spec, config) for spec in config.outputs],
    }
