"""The mlp example's torch forms: TorchScript and torch.export (both need torch)."""

from __future__ import annotations

import warnings
from pathlib import Path

from examples.model_builders.mlp import MLP_INPUT, mlp_weights

TORCHSCRIPT_FILE, TORCH_EXPORT_FILE = "model.pt", "model.pt2"


def torch_available() -> bool:
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


def _torch_mlp() -> object:
    """The mlp example as a ``torch.nn.Module`` with the same weights (plain parameters: no
    ``nn.Linear``, whose TorchScript form lists constants in hash order)."""
    import torch

    class Mlp(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            for name, array in zip(("w1", "b1", "w2", "b2"), mlp_weights(), strict=True):
                self.register_buffer(name, torch.from_numpy(array.copy()))

        def forward(self, input: torch.Tensor) -> torch.Tensor:
            hidden = torch.relu(input @ self.w1 + self.b1)
            return hidden @ self.w2 + self.b2

    return Mlp().eval()


def build_torchscript_mlp(directory: Path | str) -> Path:
    """The mlp as TorchScript (``torch.jit.trace``): ``INPUT__0`` [N,16] -> ``OUTPUT__0`` [N,4]."""
    import torch

    path = Path(directory) / TORCHSCRIPT_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():
        # TorchScript is deprecated upstream; it is still what many users bring.
        warnings.filterwarnings("ignore", r"`torch\.jit", DeprecationWarning)
        traced = torch.jit.trace(_torch_mlp(), torch.zeros(2, MLP_INPUT))
        traced.save(str(path))
    return path


def build_torch_export_mlp(directory: Path | str) -> Path:
    """The mlp as a torch.export program (batch 1..256): ``input`` [N,16] -> ``output`` [N,4]."""
    import torch

    path = Path(directory) / TORCH_EXPORT_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    batch = torch.export.Dim("batch", min=1, max=256)
    program = torch.export.export(
        _torch_mlp(), (torch.zeros(2, MLP_INPUT),), dynamic_shapes=({0: batch},)
    )
    torch.export.save(program, str(path))
    return path
