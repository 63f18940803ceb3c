"""Model directories the backend tests write: Python models, TorchScript and torch.export."""

from __future__ import annotations

import textwrap
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any


def write_model(
    root: Path, name: str, config: str, files: Mapping[str, str | bytes] | None = None
) -> Path:
    """``<root>/<name>/config.pbtxt`` (``name`` is prepended) and ``files`` (relative path ->
    content; text is dedented)."""
    model_dir = root / name
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.pbtxt").write_text(f'name: "{name}"\n{textwrap.dedent(config)}')
    for relative, content in (files or {}).items():
        path = model_dir / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(textwrap.dedent(content))
    return model_dir


def tensor(name: str, data_type: str, dims: str) -> str:
    return f'{{ name: "{name}" data_type: {data_type} dims: [ {dims} ] }}'


def python_config(
    inputs: list[str], outputs: list[str], *, max_batch_size: int = 8, extra: str = ""
) -> str:
    return (
        f'backend: "python"\nmax_batch_size: {max_batch_size}\n'
        f"input [ {', '.join(inputs)} ]\noutput [ {', '.join(outputs)} ]\n{extra}\n"
    )


def save_torchscript(module: Any, example: tuple[Any, ...], path: Path) -> Path:
    import torch

    path.parent.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", r"`torch\.jit", DeprecationWarning)
        torch.jit.trace(module, example).save(str(path))
    return path


def save_exported(module: Any, example: tuple[Any, ...], path: Path) -> Path:
    """torch.export with a dynamic first (batch) dimension on every input."""
    import torch

    path.parent.mkdir(parents=True, exist_ok=True)
    batch = torch.export.Dim("batch", min=1, max=64)
    program = torch.export.export(
        module, example, dynamic_shapes=tuple({0: batch} for _ in example)
    )
    torch.export.save(program, str(path))
    return path


FRAGILE_MODEL = """
import numpy as np


class Model:
    def execute(self, inputs):
        x = inputs["x"]
        if (x < 0).any():
            raise RuntimeError("negative input")
        return {"y": x * 2}
"""
"""A Python model that doubles ``x`` (FP32 [2]) and raises on a negative element."""


def write_fragile(repository: Path, name: str = "fragile") -> Path:
    """:data:`FRAGILE_MODEL` as ``<name>`` in ``repository``: BACKEND failures on demand."""
    return write_model(
        repository,
        name,
        python_config([tensor("x", "TYPE_FP32", "2")], [tensor("y", "TYPE_FP32", "2")]),
        {"1/model.py": FRAGILE_MODEL},
    )


DOUBLE_MODEL = """
class Model:
    def execute(self, inputs):
        return {"y": inputs["x"] * 2}
"""
"""A Python model: ``y = x * 2`` (FP32 ``x`` [2] -> ``y`` [2])."""
BROKEN_MODEL = """
class Model:
    def execute(self, inputs):
        raise RuntimeError("this model is broken")
"""
"""The same interface, failing every batch."""


def write_double_and_broken(root: Path, *, max_batch_size: int = 8) -> None:
    """``double`` and ``broken`` (see above) in the repository ``root``."""
    config = python_config(
        [tensor("x", "TYPE_FP32", "2")],
        [tensor("y", "TYPE_FP32", "2")],
        max_batch_size=max_batch_size,
    )
    write_model(root, "double", config, {"1/model.py": DOUBLE_MODEL})
    write_model(root, "broken", config, {"1/model.py": BROKEN_MODEL})
