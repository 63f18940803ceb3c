"""Checking the numeric fields of a client's JSON object: each present one must be a number
(an integer where asked) within its range, or the client is told which and why."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from sluice.core.errors import InvalidInput


def integers(
    body: Mapping[str, Any], ranges: Iterable[tuple[str, int, int]], prefix: str = ""
) -> dict[str, int]:
    """The integer fields of ``body`` named in ``ranges`` (name, low, high) it has."""
    found: dict[str, int] = {}
    for name, low, high in ranges:
        if name in body:
            value = body[name]
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise InvalidInput(f"'{prefix}{name}' must be an integer within {low}..{high}")
            found[name] = value
    return found


def numbers(
    body: Mapping[str, Any], ranges: Iterable[tuple[str, float, float]], prefix: str = ""
) -> dict[str, float]:
    """The number fields of ``body`` named in ``ranges`` (name, low, high) it has."""
    found: dict[str, float] = {}
    for name, low, high in ranges:
        if name in body:
            value = body[name]
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise InvalidInput(f"'{prefix}{name}' must be a number")
            if not low <= value <= high:
                raise InvalidInput(f"'{prefix}{name}' must be within {low}..{high}")
            found[name] = float(value)
    return found


def json_type(value: Any) -> str:
    """How a JSON value is described in messages to the client."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "list"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__
