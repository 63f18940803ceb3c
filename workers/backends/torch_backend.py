"""PyTorch backend (``platform: "pytorch_libtorch"`` / ``backend: "pytorch"``, ``torch_aoti``).

Loads a TorchScript ``model.pt`` (``torch.jit.load``), a torch.export ``model.pt2``
(``torch.export.load(...).module()``) or an AOTInductor package (a ``.pt2`` holding
compiled code, ``torch._inductor.aoti_load_package``), and runs it under
``torch.inference_mode`` on the placement's device.
"""

from __future__ import annotations

import contextlib
import inspect
import warnings
import zipfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch

from sluice.core.config import ModelConfig
from sluice.core.errors import InferenceFailed, InvalidConfig, SluiceError
from sluice.core.placement import Placement
from sluice.workers.backends.threads import int_parameter, threads_or_all
from sluice.workers.backends.torch_io import Signature, results_by_name, to_numpy, to_torch


def _device(config: ModelConfig, placement: Placement) -> torch.device:
    if placement.kind != "KIND_GPU":
        return torch.device("cpu")
    index = placement.gpu or 0
    if not torch.cuda.is_available():
        why = (
            f"this torch ({torch.__version__}) is a CPU-only build"
            if torch.version.cuda is None
            else "no NVIDIA GPU or driver is visible"
        )
        raise InvalidConfig(
            f"model '{config.name}' asks for instance kind KIND_GPU (GPU {index}), but "
            f"torch.cuda is not available: {why}; use kind KIND_CPU, or a machine with an "
            "NVIDIA GPU and a CUDA build of torch"
        )
    count = torch.cuda.device_count()
    if index >= count:
        raise InvalidConfig(
            f"model '{config.name}' asks for GPU {index}, but only {count} GPU(s) are visible"
        )
    return torch.device("cuda", index)


def _is_aoti_package(path: Path) -> bool:
    try:
        with zipfile.ZipFile(path) as archive:
            return any("/data/aotinductor/" in name for name in archive.namelist())
    except (OSError, zipfile.BadZipFile):
        return False


def _load(path: Path, device: torch.device) -> Callable[..., Any]:
    if path.suffix == ".pt2" and _is_aoti_package(path):
        from torch._inductor import aoti_load_package

        index = device.index if device.type == "cuda" else -1
        return aoti_load_package(str(path), device_index=index)
    if path.suffix == ".pt2":
        with warnings.catch_warnings():
            # Some torch releases read the archive's weights from a read-only buffer and say
            # so; the weights are copied to the device (or only read) afterwards.
            warnings.filterwarnings("ignore", "The given buffer is not writable", UserWarning)
            program = torch.export.load(str(path))
        if device.type != "cpu":
            from torch.export.passes import move_to_device_pass

            program = move_to_device_pass(program, device)
        return program.module()
    with warnings.catch_warnings():
        # TorchScript is deprecated upstream, yet it is what users bring.
        warnings.filterwarnings("ignore", r"`torch\.jit", DeprecationWarning)
        module = torch.jit.load(str(path), map_location=device)  # type: ignore[no-untyped-call]
    module.eval()
    return cast(Callable[..., Any], module)


def _forward_names(model: Callable[..., Any]) -> list[str] | None:
    """The argument names of ``forward`` (TorchScript schema, else the Python signature)."""
    forward = getattr(model, "forward", None)
    schema = getattr(forward, "schema", None)
    if schema is not None:
        return [argument.name for argument in schema.arguments if argument.name != "self"]
    if forward is None:
        return None
    try:
        parameters = inspect.signature(forward).parameters.values()
    except (TypeError, ValueError):
        return None
    names = [p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    return names or None


def _short(exc: BaseException) -> str:
    """torch errors run to pages: TorchScript's end with the cause after a traceback, the
    others start with it."""
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    if any("Traceback of TorchScript" in line for line in lines[:3]):
        return lines[-1][:500]
    text = " ".join(lines[:3])
    return f"{type(exc).__name__}: {text[:500]}"


_THREADS = range(0, 1025)


class TorchBackend:
    def __init__(self, config: ModelConfig, model_path: Path, placement: Placement) -> None:
        if not config.inputs or not config.outputs:
            raise InvalidConfig(
                f"model '{config.name}': the PyTorch backend needs every input and output "
                "declared in config.pbtxt"
            )
        self._config = config
        self._device = _device(config, placement)
        # Triton's PyTorch backend parameters, when the model sets them.
        intra = int_parameter(config.name, config.parameters, "INTRA_OP_THREAD_COUNT", _THREADS)
        inter = int_parameter(config.name, config.parameters, "INTER_OP_THREAD_COUNT", _THREADS)
        torch.set_num_threads(threads_or_all(placement.threads if intra is None else intra))
        with contextlib.suppress(RuntimeError):  # only settable before the first parallel op
            torch.set_num_interop_threads(inter or 1)
        try:
            self._model = _load(model_path, self._device)
        except Exception as exc:
            raise InvalidConfig(f"torch cannot load {model_path.name}: {_short(exc)}") from None
        self._signature = Signature.of(config, _forward_names(self._model))

    def infer(
        self,
        inputs: Mapping[str, np.ndarray],
        outputs: Sequence[str],
        request_sizes: Sequence[int] | None = None,
    ) -> dict[str, np.ndarray]:
        signature = self._signature
        tensors = {
            name: to_torch(name, array, self._config.input(name), self._device)
            for name, array in inputs.items()
        }
        args = [tensors.get(name) if name else None for name in signature.positional]
        while args and args[-1] is None:  # optional inputs left out at the end
            args.pop()
        try:
            with torch.inference_mode():
                result = self._model(*args)
                picked = results_by_name(result, outputs, signature.output_index)
                return {name: to_numpy(name, value) for name, value in picked.items()}
        except SluiceError:
            raise
        except Exception as exc:
            raise InferenceFailed(_short(exc)) from None

    def close(self) -> None:
        del self._model
        if self._device.type == "cuda":
            torch.cuda.empty_cache()
