"""Model control commands (Triton's load / unload) from gateways to ``sluice up``.

A gateway appends a command to the control stream and waits for its answer on a list of
the command's own (``Keys.control_reply``): ``{"error": null}`` when done, else the error.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

import msgpack

from sluice.rollout import OPS as ROLLOUT_OPS


@dataclass
class ControlCommand:
    op: str
    """``load``, ``unload``, or a rollout's (:data:`sluice.rollout.OPS`)."""
    model: str
    config: str | None = None
    """A load's configuration override (the model configuration as JSON); a rollout
    start's request (JSON)."""
    files: dict[str, bytes] = field(default_factory=dict)
    """A load's file overrides: path in the model directory -> content."""
    versions: tuple[int, ...] = ()
    """A load's versions to serve instead of what the version policy picks (rollouts)."""
    command_id: str = field(default_factory=lambda: uuid.uuid4().hex)


def encode_command(command: ControlCommand) -> dict[bytes, bytes]:
    body = {
        "id": command.command_id,
        "op": command.op,
        "model": command.model,
        "config": command.config,
        "files": command.files,
        "versions": list(command.versions),
    }
    return {b"c": msgpack.packb(body)}


def decode_command(fields: dict[bytes, bytes]) -> ControlCommand | None:
    """The command of a stream entry; None when it is malformed."""
    try:
        body = msgpack.unpackb(fields[b"c"])
        files = body.get("files") or {}
        config = body.get("config")
        versions = body.get("versions") or []
        if (
            not isinstance(body, dict)
            or body.get("op") not in ("load", "unload", *ROLLOUT_OPS)
            or not isinstance(files, dict)
            or not (config is None or isinstance(config, str))
            or not isinstance(versions, list)
            or not all(isinstance(v, int) and 0 < v < 1 << 63 for v in versions)
        ):
            return None
        return ControlCommand(
            body["op"],
            str(body["model"]),
            config,
            {str(k): bytes(v) for k, v in files.items()},
            tuple(sorted(set(versions))),
            str(body["id"]),
        )
    except (KeyError, TypeError, ValueError, AttributeError, msgpack.UnpackException):
        return None
