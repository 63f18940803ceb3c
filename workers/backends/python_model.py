"""Importing a Python model's ``model.py`` and finding its model class."""

from __future__ import annotations

import asyncio
import importlib.util
import inspect
import re
import sys
import traceback
from pathlib import Path
from types import ModuleType
from typing import Any

from sluice.core.errors import InferenceFailed, InvalidConfig, SluiceError
from sluice.workers.backends import triton_python_backend_utils

PB_UTILS = "triton_python_backend_utils"


def describe(exc: BaseException, model_file: Path) -> str:
    """``"TypeError: ... (model.py line 12)"``: where in the user's file it went wrong."""
    line = next(
        (
            frame.lineno
            for frame in reversed(traceback.extract_tb(exc.__traceback__))
            if Path(frame.filename) == model_file
        ),
        None,
    )
    where = f" ({model_file.name} line {line})" if line else ""
    return f"{type(exc).__name__}: {exc}{where}"


def import_model_file(model_file: Path, module_name: str) -> ModuleType:
    """Import ``model_file`` as ``module_name``; its folder goes first on ``sys.path`` so
    modules next to it import, as with Triton. No ``__pycache__`` is written into the
    model repository."""
    sys.modules.setdefault(PB_UTILS, triton_python_backend_utils)
    spec = importlib.util.spec_from_file_location(module_name, model_file)
    if spec is None or spec.loader is None:
        raise InvalidConfig(f"{model_file.name} cannot be imported")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    folder = str(model_file.parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    writes_bytecode = sys.dont_write_bytecode
    sys.dont_write_bytecode = True
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        forget_module(module_name, model_file)
        raise InvalidConfig(
            f"{model_file.name} cannot be imported: {describe(exc, model_file)}"
        ) from None
    finally:
        sys.dont_write_bytecode = writes_bytecode
    return module


def forget_module(module_name: str, model_file: Path) -> None:
    sys.modules.pop(module_name, None)
    folder = str(model_file.parent)
    if folder in sys.path:
        sys.path.remove(folder)


def module_name_for(model: str, model_file: Path) -> str:
    slug = re.sub(r"\W", "_", f"{model}_{model_file.parent.name}")
    return f"sluice_model_{slug}"


def find_model_class(module: ModuleType, model_file: Path) -> tuple[type, bool]:
    """The model class and whether it is written for Triton's Python backend."""
    triton = getattr(module, "TritonPythonModel", None)
    if isinstance(triton, type):
        return triton, True
    simple = getattr(module, "Model", None)
    if isinstance(simple, type):
        return simple, False
    candidates = [
        value
        for value in vars(module).values()
        if isinstance(value, type)
        and value.__module__ == module.__name__
        and callable(getattr(value, "execute", None))
    ]
    if len(candidates) == 1:
        return candidates[0], False
    found = ", ".join(sorted(c.__name__ for c in candidates)) or "none"
    raise InvalidConfig(
        f"{model_file.name} must define class Model (or TritonPythonModel, or exactly one "
        f"class with an execute method); classes with execute: {found}"
    )


def call_model(model_file: Path, what: str, function: Any, *args: Any) -> Any:
    """Call a method of the user's model; its errors become InferenceFailed with a location.

    SluiceErrors pass through, so a model may raise ``InvalidInput`` for a 400.
    A coroutine (``async def execute``) is run to completion.
    """
    try:
        result = function(*args)
        if inspect.iscoroutine(result):
            result = asyncio.run(result)
        return result
    except SluiceError:
        raise
    except Exception as exc:
        raise InferenceFailed(f"{what} raised {describe(exc, model_file)}") from None


def accepts_arguments(function: Any) -> int:
    """How many positional arguments ``function`` (a bound method) takes; -1 for *args."""
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):
        return 1
    if any(p.kind is p.VAR_POSITIONAL for p in parameters):
        return -1
    return sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in parameters)
