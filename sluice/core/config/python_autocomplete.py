"""Triton's ``auto_complete_config`` for Python models: a ``TritonPythonModel`` may fill in
its own inputs, outputs, batch size, batching and transaction policy.

The model's code runs in a child process (``python -m sluice.workers.backends.python_autocomplete``)
with a time limit, never in the process reading the repository; only models whose
``model.py`` mentions ``auto_complete_config`` pay for it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from sluice.core.errors import InvalidConfig

from .model import ModelConfig
from .parse import config_from_json, config_to_json

TIMEOUT_S = 30.0
_MARK = b"auto_complete_config"
_MAX_SOURCE_BYTES = 16 << 20
_MAX_ANSWER_BYTES = 1 << 20


def wants_python_autocomplete(config: ModelConfig, model_file: Path) -> bool:
    if config.backend != "python" or model_file.is_symlink() or not model_file.is_file():
        return False
    try:
        with model_file.open("rb") as source:
            return _MARK in source.read(_MAX_SOURCE_BYTES)
    except OSError:
        return False


def autocomplete_python(config: ModelConfig, model_file: Path) -> ModelConfig:
    """The configuration as the model's ``auto_complete_config`` completes it."""
    command = [sys.executable, "-m", "sluice.workers.backends.python_autocomplete", str(model_file)]
    try:
        done = subprocess.run(
            command,
            input=json.dumps(config_to_json(config)).encode(),
            capture_output=True,
            timeout=TIMEOUT_S,
            env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
            check=False,
        )
    except subprocess.TimeoutExpired:
        raise InvalidConfig(
            f"{model_file.name}: auto_complete_config did not finish within {TIMEOUT_S:g} s"
        ) from None
    if done.returncode != 0:
        lines = done.stderr.decode(errors="replace").strip().splitlines()
        reason = lines[-1] if lines else f"exit status {done.returncode}"
        raise InvalidConfig(f"{model_file.name}: auto_complete_config failed: {reason[:500]}")
    if len(done.stdout) > _MAX_ANSWER_BYTES:
        raise InvalidConfig(f"{model_file.name}: auto_complete_config made a huge configuration")
    try:
        completed = json.loads(done.stdout)
    except ValueError:
        raise InvalidConfig(
            f"{model_file.name}: auto_complete_config wrote no configuration"
        ) from None
    return config_from_json(completed, model_name=config.name)
