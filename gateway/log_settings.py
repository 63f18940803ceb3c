"""Triton's logging extension, transport-neutral: the changes a settings document asks
for, checked in Triton's order with Triton's error texts (REST's ``POST /v2/logging`` body
and gRPC's ``LogSettings`` both end here)."""

from __future__ import annotations

from typing import Any

from sluice.core.errors import InvalidInput, Unsupported
from sluice.core.logs import FORMATS

_BOOLEAN = "attempt to access JSON non-boolean as boolean"
_UNSIGNED = "attempt to access JSON non-unsigned-integer as unsigned-integer"
_STRING = "attempt to access JSON non-string as string"
_MAX_UINT64 = (1 << 64) - 1


def log_changes(document: dict[str, Any]) -> dict[str, Any]:
    """The changes a settings document asks for (POST's body, or gRPC's settings)."""
    changes: dict[str, Any] = {}
    if document.get("log_file") is not None:
        raise Unsupported("log file location can not be updated through network protocol")
    for argument in ("info", "warning", "error"):
        value = document.get(f"log_{argument}")
        if value is not None:
            if not isinstance(value, bool):
                raise InvalidInput(_BOOLEAN)
            changes[argument] = value
    level = document.get("log_verbose_level")
    if level is not None:
        if isinstance(level, bool) or not isinstance(level, int) or not 0 <= level <= _MAX_UINT64:
            raise InvalidInput(_UNSIGNED)
        changes["verbose_level"] = level
    log_format = document.get("log_format")
    if log_format is not None:
        if not isinstance(log_format, str):
            raise InvalidInput(_STRING)
        if log_format not in FORMATS:
            raise InvalidInput(f"invalid argument for --log_format, got: {log_format}")
        changes["format"] = log_format
    return changes
