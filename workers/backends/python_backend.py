"""Python models (``backend: "python"``): a class in ``<version>/model.py``.

Sluice's own API, whole batches at a time::

    class Model:
        def initialize(self, config: dict, context: ModelContext) -> None: ...  # optional;
            # config is the model configuration as Triton JSON; context is optional too
        def execute(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]: ...
        def finalize(self) -> None: ...  # optional

Models written for Triton's Python backend (``class TritonPythonModel``) run
through :mod:`workers.backends.triton_python`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from sluice.config import ModelConfig, config_to_json
from sluice.errors import InferenceFailed, InvalidConfig
from workers.backends.base import Backend, Placement
from workers.backends.python_model import (
    accepts_arguments,
    call_model,
    describe,
    find_model_class,
    forget_module,
    import_model_file,
    module_name_for,
)


@dataclass(frozen=True, slots=True)
class ModelContext:
    """Where this instance of a Python model runs (``initialize``'s optional 2nd argument)."""

    name: str
    version: int
    model_dir: Path
    """``<repository>/<model>``: files next to config.pbtxt live here."""
    kind: str
    """"KIND_CPU" or "KIND_GPU" (the model itself decides how to use the GPU)."""
    device_id: int
    threads: int


def _version_of(model_file: Path) -> int:
    return int(model_file.parent.name) if model_file.parent.name.isdigit() else 0


def load_python_backend(config: ModelConfig, model_file: Path, placement: Placement) -> Backend:
    module_name = module_name_for(config.name, model_file)
    module = import_model_file(model_file, module_name)
    try:
        cls, triton_style = find_model_class(module, model_file)
        try:
            instance = cls()
        except Exception as exc:
            raise InvalidConfig(
                f"{model_file.name}: {cls.__name__}() failed: {describe(exc, model_file)}"
            ) from None
        if triton_style:
            from workers.backends.triton_python import TritonPythonBackend

            return TritonPythonBackend(instance, config, model_file, placement, module_name)
        return SimplePythonBackend(instance, config, model_file, placement, module_name)
    except BaseException:
        forget_module(module_name, model_file)
        raise


def _initialize(instance: Any, model_file: Path, *args: Any) -> None:
    initialize = getattr(instance, "initialize", None)
    if initialize is None:
        return
    wanted = accepts_arguments(initialize)
    try:
        call_model(model_file, "initialize", initialize, *(args if wanted < 0 else args[:wanted]))
    except InferenceFailed as exc:
        raise InvalidConfig(f"{model_file.name}: {exc.message}") from None


class SimplePythonBackend:
    def __init__(
        self,
        instance: Any,
        config: ModelConfig,
        model_file: Path,
        placement: Placement,
        module_name: str,
    ) -> None:
        self._model = instance
        self._file = model_file
        self._module_name = module_name
        context = ModelContext(
            name=config.name,
            version=_version_of(model_file),
            model_dir=model_file.parent.parent,
            kind=placement.kind,
            device_id=placement.gpu or 0,
            threads=placement.threads,
        )
        _initialize(instance, model_file, config_to_json(config), context)

    def infer(
        self,
        inputs: Mapping[str, np.ndarray],
        outputs: Sequence[str],
        request_sizes: Sequence[int] | None = None,
    ) -> dict[str, np.ndarray]:
        result = call_model(self._file, "execute", self._model.execute, dict(inputs))
        if not isinstance(result, Mapping):
            raise InferenceFailed(
                f"{self._file.name}: execute must return a dict of output name -> numpy "
                f"array, not {type(result).__name__}"
            )
        missing = [name for name in outputs if name not in result]
        if missing:
            raise InferenceFailed(
                f"{self._file.name}: execute returned no output '{missing[0]}' "
                f"(it returned {', '.join(map(str, result)) or 'nothing'})"
            )
        return {name: np.asarray(result[name]) for name in outputs}

    def close(self) -> None:
        try:
            finalize = getattr(self._model, "finalize", None)
            if finalize is not None:
                call_model(self._file, "finalize", finalize)
        finally:
            forget_module(self._module_name, self._file)
