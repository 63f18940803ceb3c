"""``sluice infer --save-dir``: every output saved without pickle (sluice.cli.infer_command)."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import numpy as np
from rich.console import Console

from sluice.cli.infer_command import _save


def test_outputs_are_saved_without_pickle(tmp_path: Path) -> None:
    text = np.array([[b"hi"], [b"there"]], dtype=object)
    nul = np.array([b"a\0", b"b"], dtype=object)  # fixed-width bytes would drop the NUL
    numbers = np.arange(6, dtype=np.float32).reshape(2, 3)
    _save(Console(file=io.StringIO()), tmp_path, {"t": text, "n/ul": nul, "x": numbers})
    assert np.load(tmp_path / "t.npy", allow_pickle=False).tolist() == [[b"hi"], [b"there"]]
    np.testing.assert_array_equal(np.load(tmp_path / "x.npy", allow_pickle=False), numbers)
    document = json.loads((tmp_path / "n_ul.json").read_text())
    assert document["shape"] == [2]
    assert [base64.b64decode(e) for e in document["base64"]] == [b"a\0", b"b"]
    assert not (tmp_path / "n_ul.npy").exists()
