"""all-MiniLM-L6-v2's tokenizer (WordPiece, lower-cased), written with Sluice's Python model
API: the first step of the ``minilm_embedding`` ensemble.

``execute`` receives a whole batch: ``TEXT`` is an object array of bytes of shape [batch, 1].
Each string is encoded with the ``tokenizers`` library from ``tokenizer.json`` in this
folder (``build.py`` copies it here: nothing is read from site-packages at serve time),
truncated at ``max_seq_length`` tokens (a parameter of config.pbtxt; 256 as
sentence-transformers uses for this model) and padded with [PAD] (id 0) to the longest
of the batch. The file's own settings (truncate and pad to a fixed 128) are replaced.

Padding to the longest of the batch matters downstream too: the requests tokenized
together come out with one sequence length, so the transformer's dynamic batcher (which
batches only requests of equal shape, as Triton's does) can run them together.

Text that is not UTF-8 is refused with a 400 naming the item; an empty string encodes as
``[CLS] [SEP]``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer

from sluice.core.errors import InvalidInput

TOKENIZER_FILE = Path(__file__).resolve().parent / "tokenizer.json"
DEFAULT_MAX_SEQ_LENGTH = 256


def load_tokenizer(
    path: Path = TOKENIZER_FILE, max_length: int = DEFAULT_MAX_SEQ_LENGTH
) -> Tokenizer:
    """The tokenizer as served: truncation at ``max_length``, padding to the longest."""
    tokenizer = Tokenizer.from_file(str(path))
    tokenizer.no_padding()
    tokenizer.enable_truncation(max_length=max_length)
    pad_id = tokenizer.token_to_id("[PAD]")
    tokenizer.enable_padding(pad_id=0 if pad_id is None else pad_id, pad_token="[PAD]")
    return tokenizer


def decode(text: np.ndarray) -> list[str]:
    """Each item of ``TEXT`` as str; a 400 for the first one that is not UTF-8."""
    decoded = []
    for index, value in enumerate(text.reshape(-1)):
        raw = value if isinstance(value, bytes) else str(value).encode()
        try:
            decoded.append(raw.decode("utf-8"))
        except UnicodeDecodeError as exc:
            raise InvalidInput(
                f"input 'TEXT': item {index} is not valid UTF-8 ({exc.reason} at byte {exc.start})"
            ) from None
    return decoded


class Model:
    def initialize(self, config: dict[str, Any]) -> None:
        parameter = config.get("parameters", {}).get("max_seq_length", {})
        max_length = int(parameter.get("string_value") or DEFAULT_MAX_SEQ_LENGTH)
        self.tokenizer = load_tokenizer(TOKENIZER_FILE, max_length)

    def execute(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        encodings = self.tokenizer.encode_batch(decode(inputs["TEXT"]))
        return {
            "input_ids": np.array([e.ids for e in encodings], dtype=np.int64),
            "attention_mask": np.array([e.attention_mask for e in encodings], dtype=np.int64),
        }
