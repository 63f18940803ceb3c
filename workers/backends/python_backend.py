"""Python models (``backend: "python"``): a class in ``<version>/model.py``.

Sluice's own API, whole batches at a time::

    class Model:
        def initialize(self, config: dict, context: ModelContext) -> None: ...  # optional;
            # config is the model configuration as Triton JSON; context is optional too
        def execute(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]: ...
        def finalize(self) -> None: ...  # optional

``execute`` may be ``async def``. It may call other models with the context kept from
``initialize``: ``context.infer("other", {"X": x})`` (or ``await context.infer_async(...)``),
Triton's BLS in this API's style. A batch whose ``allow_ragged_batch`` inputs differ in
shape runs once per group of requests whose shapes agree (``execute`` takes one array per
input).

Models written for Triton's Python backend (``class TritonPythonModel``) run
through :mod:`sluice.workers.backends.triton_python`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from sluice.core.clock import CLOCK
from sluice.core.config import ModelConfig, config_to_json
from sluice.core.errors import InferenceFailed, InvalidConfig, SluiceError
from sluice.core.placement import Placement
from sluice.workers import ragged
from sluice.workers.backends.base import Backend, Emit
from sluice.workers.backends.ensemble_join import split_requests
from sluice.workers.backends.python_model import (
    accepts_arguments,
    call_model,
    describe,
    find_model_class,
    forget_module,
    import_model_file,
    module_name_for,
)
from sluice.workers.model_calls import CallContext, process_calls
from sluice.workers.ragged import RaggedInputs, RaggedOutputs
from sluice.workers.serving import serving_tenant


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

    def infer(
        self,
        model: str,
        inputs: Mapping[str, np.ndarray],
        outputs: Sequence[str] = (),
        *,
        version: int = -1,
        timeout_s: float | None = None,
    ) -> dict[str, np.ndarray]:
        """Call another model of this deployment from ``execute`` (Triton's BLS, in Sluice's
        style): its ``outputs`` (all when none are named); its error is raised as the
        Sluice error it answered (``InvalidInput``, ``Unavailable``, ...). Datatypes are
        those the called model's config gives its inputs."""
        calls = process_calls()
        return calls.call_soon(
            calls.submit(model, version, *_call_args(inputs, outputs, timeout_s))
        )

    async def infer_async(
        self,
        model: str,
        inputs: Mapping[str, np.ndarray],
        outputs: Sequence[str] = (),
        *,
        version: int = -1,
        timeout_s: float | None = None,
    ) -> dict[str, np.ndarray]:
        """:meth:`infer` for ``async def execute``: calls made together run together."""
        calls = process_calls()
        call = calls.submit(model, version, *_call_args(inputs, outputs, timeout_s))
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(call, calls.loop))


def _call_args(
    inputs: Mapping[str, np.ndarray], outputs: Sequence[str], timeout_s: float | None
) -> tuple[list[tuple[str, str, np.ndarray]], list[str], CallContext]:
    deadline_ns = CLOCK.now_ns() + int(timeout_s * 1e9) if timeout_s else 0
    tensors = [(name, "", np.asarray(array)) for name, array in inputs.items()]
    tenant, shared = serving_tenant()
    return (
        tensors,
        list(outputs),
        CallContext(deadline_ns=deadline_ns, tenant=tenant, shared=shared),
    )


def _rows(name: str, array: np.ndarray, items: int, start: int, count: int) -> np.ndarray:
    """Rows ``start`` to ``start + count`` of output ``name`` of a batch of ``items``."""
    if array.ndim == 0 or array.shape[0] != items:
        raise InferenceFailed(
            f"output '{name}' has batch dimension {array.shape[:1]} for {items} batch items"
        )
    return array[start : start + count]


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
            from sluice.workers.backends.triton_python import TritonPythonBackend

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
        self._batched = config.max_batch_size > 0
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
        if isinstance(inputs, RaggedInputs):
            return self._infer_alike(inputs, outputs, list(request_sizes or [1]))
        result = call_model(self._file, "execute", self._model.execute, dict(inputs))
        return self._checked(result, outputs, "execute", "return")

    def _infer_alike(
        self, inputs: RaggedInputs, outputs: Sequence[str], sizes: Sequence[int]
    ) -> dict[str, np.ndarray]:
        """A batch whose ragged inputs differ in shape: ``execute`` runs once for each group
        of requests whose shapes agree, and each request gets its rows of its group's
        outputs (an output whose shapes differ between groups stays each request's own)."""
        requests = ragged.request_inputs(inputs, sizes, batched=True)
        answers: list[dict[str, np.ndarray]] = [{} for _ in requests]
        for group in ragged.alike(requests):
            joined = {
                name: np.concatenate([requests[i][name] for i in group], axis=0)
                for name in requests[group[0]]
            }
            result = call_model(self._file, "execute", self._model.execute, joined)
            arrays = self._checked(result, outputs, "execute", "return")
            items = sum(sizes[i] for i in group)
            start = 0
            for index in group:
                answers[index] = {
                    name: _rows(name, array, items, start, sizes[index])
                    for name, array in arrays.items()
                }
                start += sizes[index]
        merged: dict[str, np.ndarray] = {}
        own: dict[str, list[np.ndarray]] = {}
        for name in outputs:
            parts = [answer[name] for answer in answers]
            if ragged.differ(parts):
                own[name], merged[name] = parts, ragged.concatenated(parts)
            else:
                merged[name] = np.concatenate(parts, axis=0)
        return RaggedOutputs(merged, {}, own) if own else merged

    def infer_stream(
        self,
        inputs: Mapping[str, np.ndarray],
        outputs: Sequence[str],
        request_sizes: Sequence[int] | None,
        emit: Emit,
    ) -> None:
        """A decoupled model: ``stream(inputs)``, a generator, runs once per request and
        each dict it yields is one response; its end is the final one."""
        stream = getattr(self._model, "stream", None)
        if stream is None:
            raise InferenceFailed(
                f"{self._file.name}: a decoupled model (model_transaction_policy) defines "
                "stream(self, inputs), a generator of output dicts"
            )
        sizes = list(request_sizes or [1])
        if isinstance(inputs, RaggedInputs):
            parts = ragged.request_inputs(inputs, sizes, self._batched)
        else:
            parts = split_requests(inputs, sizes, self._batched)
        for index, part in enumerate(parts):
            try:
                for response in call_model(self._file, "stream", stream, part):
                    emit(index, self._checked(response, outputs, "stream", "yield"), False)
            except SluiceError as exc:
                emit(index, exc, True)
                continue
            except Exception as exc:
                emit(index, InferenceFailed(f"stream raised {describe(exc, self._file)}"), True)
                continue
            emit(index, None, True)

    def _checked(
        self, result: Any, outputs: Sequence[str], method: str, verb: str
    ) -> dict[str, np.ndarray]:
        """``outputs`` of what ``method`` gave (it must ``verb`` a dict of arrays)."""
        if not isinstance(result, Mapping):
            raise InferenceFailed(
                f"{self._file.name}: {method} must {verb} a dict of output name -> numpy "
                f"array, not {type(result).__name__}"
            )
        missing = [name for name in outputs if name not in result]
        if missing:
            done = "returned" if verb == "return" else "yielded"
            raise InferenceFailed(
                f"{self._file.name}: {method} {done} no output '{missing[0]}' "
                f"(it {done} {', '.join(map(str, result)) or 'nothing'})"
            )
        return {name: np.asarray(result[name]) for name in outputs}

    def close(self) -> None:
        try:
            finalize = getattr(self._model, "finalize", None)
            if finalize is not None:
                call_model(self._file, "finalize", finalize)
        finally:
            forget_module(self._module_name, self._file)
