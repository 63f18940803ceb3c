"""``python -m bench.gpu_repository DIR``: a repository for benchmarking on a GPU host, as a
user's would look: the ONNX examples on the CPU beside ``gpu_mlp``, a TorchScript model on
``KIND_GPU`` (1024 -> 4096 -> 4096 -> 1024, GELU, about 25 M parameters, seeded weights).

Then ``python -m bench --model gpu_mlp --model-repository DIR`` serves it with defaults and
compares it with the same file run by torch in-process on the same GPU.
"""

from __future__ import annotations

import argparse
import importlib.util
import warnings
from pathlib import Path

WIDTH_IN, HIDDEN, WIDTH_OUT = 1024, 4096, 1024
MAX_BATCH = 256

CONFIG = f"""\
name: "gpu_mlp"
platform: "pytorch_libtorch"
max_batch_size: {MAX_BATCH}
input [ {{ name: "INPUT__0" data_type: TYPE_FP32 dims: [ {WIDTH_IN} ] }} ]
output [ {{ name: "OUTPUT__0" data_type: TYPE_FP32 dims: [ {WIDTH_OUT} ] }} ]
instance_group [ {{ count: 1 kind: KIND_GPU gpus: [ 0 ] }} ]
dynamic_batching {{ max_queue_delay_microseconds: 2000 }}
"""


def build_gpu_mlp(root: Path) -> Path:
    import torch

    torch.manual_seed(0)
    module = torch.nn.Sequential(
        torch.nn.Linear(WIDTH_IN, HIDDEN),
        torch.nn.GELU(),
        torch.nn.Linear(HIDDEN, HIDDEN),
        torch.nn.GELU(),
        torch.nn.Linear(HIDDEN, WIDTH_OUT),
    ).eval()
    path = root / "gpu_mlp" / "1" / "model.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        torch.jit.trace(module, torch.zeros(2, WIDTH_IN)).save(str(path))
    (root / "gpu_mlp" / "config.pbtxt").write_text(CONFIG)
    return path


def build(root: Path) -> list[Path]:
    examples = Path(__file__).resolve().parent.parent / "model_repository" / "build.py"
    spec = importlib.util.spec_from_file_location("model_repository_build", examples)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    built: list[Path] = module.build_all(root, models=("mlp", "cnn", "text_stats"))
    return [*built, build_gpu_mlp(root)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_repository", description=__doc__)
    parser.add_argument("directory", type=Path)
    args = parser.parse_args(argv)
    for path in build(args.directory):
        print(f"built {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
