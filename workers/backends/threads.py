"""How many compute threads a model instance uses, and the engines' thread settings that a
model's ``parameters`` in config.pbtxt may set, as Triton's backends read them.

By default an instance may use every core this process may run on, divided among the
instances of its own model (``sluice up`` passes that share as ``--threads``; other models'
idle workers take none), as onnxruntime and Triton's onnxruntime backend do by default. An
explicit ``SLUICE_THREADS``, or the model's own parameters, win.
"""

from __future__ import annotations

from collections.abc import Mapping

from sluice.core.errors import InvalidConfig
from sluice.core.runtime import usable_cores


def threads_or_all(threads: int) -> int:
    """``threads``, or every usable core for 0."""
    return threads if threads > 0 else usable_cores()


def int_parameter(
    model: str, parameters: Mapping[str, str], name: str, allowed: range
) -> int | None:
    """An integer ``parameters { key: name ... }`` (None when absent), checked."""
    raw = parameters.get(name)
    if raw is None:
        return None
    try:
        value = int(raw.strip())
    except ValueError:
        value = None
    if value is None or value not in allowed:
        raise InvalidConfig(
            f"model '{model}': parameter '{name}' must be an integer from {allowed.start} to "
            f"{allowed.stop - 1}, got {raw!r}"
        )
    return value


def flag_parameter(model: str, parameters: Mapping[str, str], name: str) -> bool | None:
    """A 0/1 (or true/false) parameter; None when absent."""
    raw = parameters.get(name)
    if raw is None:
        return None
    value = raw.strip().lower()
    if value in ("1", "true", "on", "yes"):
        return True
    if value in ("0", "false", "off", "no"):
        return False
    raise InvalidConfig(f"model '{model}': parameter '{name}' must be 0 or 1, got {raw!r}")
