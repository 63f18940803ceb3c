"""``python -m sluice.workers.backends.python_autocomplete MODEL_PY``: Triton's
``TritonPythonModel.auto_complete_config``, run in a process of its own.

The model configuration arrives as Triton JSON on stdin; the completed one leaves on stdout.
A process of its own because completing a configuration imports the user's ``model.py``:
the processes that read the repository (``sluice up``, the gateway's catalog) never import
user code, and a model that hangs or crashes while being imported takes only this process
with it (the caller gives it a time limit).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, cast

from sluice.workers.backends.python_model import find_model_class, import_model_file

MAX_CONFIG_BYTES = 1 << 20


class ModelConfigAutoComplete:
    """What ``auto_complete_config(auto_complete_model_config)`` receives (Triton's API)."""

    def __init__(self, config: dict[str, Any]) -> None:
        self._config = config

    def as_dict(self) -> dict[str, Any]:
        return cast(dict[str, Any], json.loads(json.dumps(self._config)))

    def _add(self, kind: str, tensor: Any) -> None:
        if not isinstance(tensor, dict) or not isinstance(tensor.get("name"), str):
            raise ValueError(f"add_{kind} takes a dict with a 'name'")
        known = {t.get("name"): t for t in self._config.setdefault(kind, [])}
        existing = known.get(tensor["name"])
        if existing is None:
            self._config[kind].append(dict(tensor))
            return
        for key in ("data_type", "dims"):
            if key in tensor and key in existing and _same(existing[key]) != _same(tensor[key]):
                raise ValueError(
                    f"{kind} '{tensor['name']}': {key} {tensor[key]} differs from the "
                    f"configuration's {existing[key]}"
                )

    def add_input(self, input: dict[str, Any]) -> None:
        self._add("input", input)

    def add_output(self, output: dict[str, Any]) -> None:
        self._add("output", output)

    def set_max_batch_size(self, max_batch_size: int) -> None:
        current = int(self._config.get("max_batch_size", 0) or 0)
        if current and current != max_batch_size:
            raise ValueError(
                f"set_max_batch_size({max_batch_size}): the configuration says {current}"
            )
        self._config["max_batch_size"] = int(max_batch_size)

    def set_dynamic_batching(self) -> None:
        if "sequence_batching" not in self._config and "ensemble_scheduling" not in self._config:
            self._config.setdefault("dynamic_batching", {})

    def set_model_transaction_policy(self, policy: dict[str, Any]) -> None:
        self._config["model_transaction_policy"] = dict(policy)

    def add_parameter(self, key: str, value: str) -> None:
        self._config.setdefault("parameters", {})[key] = {"string_value": str(value)}


def _same(value: Any) -> Any:
    return [str(v) for v in value] if isinstance(value, list) else str(value)


def main(argv: list[str]) -> int:
    model_file = Path(argv[0])
    config = json.loads(sys.stdin.read(MAX_CONFIG_BYTES))
    module = import_model_file(model_file, "sluice_autocomplete_model")
    cls, triton_style = find_model_class(module, model_file)
    complete = getattr(cls, "auto_complete_config", None) if triton_style else None
    if complete is not None:
        recorder = ModelConfigAutoComplete(config)
        result = complete(recorder)
        config = (result if isinstance(result, ModelConfigAutoComplete) else recorder).as_dict()
    sys.stdout.write(json.dumps(config))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except Exception as exc:  # the caller shows this line as the reason
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
        sys.exit(1)
