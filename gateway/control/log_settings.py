"""Triton's logging extension, transport-neutral: the changes a settings document asks
for, checked in Triton's order with Triton's error texts (REST's ``POST /v2/logging`` body
and gRPC's ``LogSettings`` both end here), and their application to every gateway process.

A change is written to Redis (:attr:`sluice.core.keys.Keys.log_settings`, with a revision)
and applied at once in the process that answers it; the other gateway processes apply it at
their next catalog refresh (``SLUICE_CATALOG_REFRESH_S``), and a gateway process that starts
later applies it before it serves. The changes expire a minute after the last gateway
stopped renewing them, so a deployment started anew begins from its own settings.

A process applies the stored changes whenever they differ from those it applied last, not
when their revision number is new alone: after Redis lost them (a restart, a replica taking
over) the numbers start again, and a later change may carry a number a process has seen.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from sluice.core.errors import InvalidInput, Unsupported
from sluice.core.observability.logs import FORMATS, LogOptions, control
from sluice.gateway.state import GatewayState

_BOOLEAN = "attempt to access JSON non-boolean as boolean"
_UNSIGNED = "attempt to access JSON non-unsigned-integer as unsigned-integer"
_STRING = "attempt to access JSON non-string as string"
_MAX_UINT64 = (1 << 64) - 1
MAX_VERBOSE_LEVEL = (1 << 32) - 1
"""Triton's protocol carries the level as a uint32 (gRPC's ``uint32_param``): a larger one
would be stored for every process, and no gRPC ``LogSettings`` answer could report it."""

log = logging.getLogger(__name__)


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
        if level > MAX_VERBOSE_LEVEL:
            raise InvalidInput(
                f"log_verbose_level must be at most {MAX_VERBOSE_LEVEL} (a uint32, as Triton's "
                f"protocol carries it); got {level}"
            )
        changes["verbose_level"] = level
    log_format = document.get("log_format")
    if log_format is not None:
        if not isinstance(log_format, str):
            raise InvalidInput(_STRING)
        if log_format not in FORMATS:
            raise InvalidInput(f"invalid argument for --log_format, got: {log_format}")
        changes["format"] = log_format
    return changes


SETTINGS_TTL_S = 60.0
"""The least time the changes outlive the last renewal by a gateway."""

_REVISION = b"rev"
"""Counts the changes: each one stores something new, even one that repeats the values."""
_FLAGS = ("info", "warning", "error")


@dataclass
class _Followed:
    stored: dict[bytes, bytes] = field(default_factory=dict)
    """The stored changes this process applied last (empty: none)."""


_followed = _Followed()


def _ttl_ms(state: GatewayState) -> int:
    return int(max(SETTINGS_TTL_S, 20 * state.settings.catalog_refresh_s) * 1000)


def _apply(stored: dict[bytes, bytes]) -> LogOptions:
    """Apply the changes stored in Redis to this process's log settings. A value no process
    of this version could have written (another version's, or damage) is skipped, said once
    in the log: raising would fail every refresh and GET while the gateways renew it."""
    changes: dict[str, Any] = {}
    skipped: list[str] = []
    for name in _FLAGS:
        value = stored.get(name.encode())
        if value in (b"0", b"1"):
            changes[name] = value == b"1"
        elif value is not None:
            skipped.append(name)
    level = stored.get(b"verbose_level")
    if level is not None:
        # (the length first: int() refuses thousands of digits, and is slow on them)
        if level.isdigit() and len(level) <= 10 and int(level) <= MAX_VERBOSE_LEVEL:
            changes["verbose_level"] = int(level)
        else:
            skipped.append("verbose_level")
    log_format = stored.get(b"format")
    if log_format is not None:
        if log_format.decode(errors="replace") in FORMATS:
            changes["format"] = log_format.decode()
        else:
            skipped.append("format")
    if skipped:
        log.warning("log settings: ignoring malformed stored values of %s", ", ".join(skipped))
    _followed.stored = stored
    return control().update(**changes)


def _stored_value(value: Any) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    return str(value)


async def change_log_settings(state: GatewayState, changes: dict[str, Any]) -> LogOptions:
    """Apply ``changes`` (:func:`log_changes`) to every gateway process: here now, in the
    others of this host before their next request, on other hosts at their next refresh.
    No changes: the settings as they are, caught up first."""
    if not changes:
        await follow_log_settings(state)
        return control().options
    key = state.keys.log_settings
    async with state.redis.pipeline(transaction=True) as pipe:
        pipe.hset(key, mapping={name: _stored_value(v) for name, v in changes.items()})
        pipe.hincrby(key, _REVISION.decode(), 1)
        pipe.pexpire(key, _ttl_ms(state))
        pipe.hgetall(key)
        *_, stored = await pipe.execute()
    state.host_changes.bump()  # the other gateway processes of this host follow at once
    return _apply(stored)


async def follow_log_settings(state: GatewayState) -> None:
    """Apply the changes another gateway process stored, if any are new; renews them."""
    key = state.keys.log_settings
    async with state.redis.pipeline(transaction=False) as pipe:
        pipe.hgetall(key)
        pipe.pexpire(key, _ttl_ms(state))
        stored, _ = await pipe.execute()
    if stored and stored != _followed.stored:
        _apply(stored)
