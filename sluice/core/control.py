"""Model control commands: Triton's load / unload (gateways and the controller to the
executor, ``sluice up``) and rollouts (gateways to the leading controller).

The sender appends a command to a stream and waits for its answer on a list of the
command's own (``Keys.control_reply``): ``{"error": null}`` when done, else the error.
Commands the controller sends carry its fencing token: an executor refuses a command whose
token is older than one it has already seen, so a deposed leader's late command is never
carried out after its successor's.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass, field
from typing import Any, cast

import msgpack
import orjson
from redis import Redis

from sluice.core.keys import Keys
from sluice.core.rollout import OPS as ROLLOUT_OPS

log = logging.getLogger(__name__)

NOT_ALLOWED = "explicit model load / unload is not allowed if polling is enabled"
"""Triton's answer to load / unload when model control is not explicit (modes NONE, POLL)."""


@dataclass
class ControlCommand:
    op: str
    """``load``, ``unload``, or a rollout's (:data:`sluice.core.rollout.OPS`)."""
    model: str
    config: str | None = None
    """A load's configuration override (the model configuration as JSON); a rollout
    start's request (JSON)."""
    files: dict[str, bytes] = field(default_factory=dict)
    """A load's file overrides: path in the model directory -> content."""
    versions: tuple[int, ...] = ()
    """A load's versions to serve instead of what the version policy picks (rollouts)."""
    command_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    token: int = 0
    """The fencing token of the controller that sent it; 0 for a gateway's."""
    keep_files: bool = False
    """A load's ``files`` are added to the model's current files instead of replacing them
    (a TorchServe version registered beside those served)."""
    dependents: bool = False
    """An unload's ``unload_dependents``: also unload the models an ensemble calls that no
    other loaded model calls."""


def encode_command(command: ControlCommand) -> dict[bytes, bytes]:
    body = {
        "id": command.command_id,
        "op": command.op,
        "model": command.model,
        "config": command.config,
        "files": command.files,
        "versions": list(command.versions),
        "token": command.token,
        "keep": command.keep_files,
        "deps": command.dependents,
    }
    return {b"c": msgpack.packb(body)}


def decode_command(fields: dict[bytes, bytes]) -> ControlCommand | None:
    """The command of a stream entry; None when it is malformed."""
    try:
        body = msgpack.unpackb(fields[b"c"])
        files = body.get("files") or {}
        config = body.get("config")
        versions = body.get("versions") or []
        token = body.get("token") or 0
        keep = body.get("keep") or False
        dependents = body.get("deps") or False
        if (
            not isinstance(body, dict)
            or body.get("op") not in ("load", "unload", *ROLLOUT_OPS)
            or not isinstance(files, dict)
            or not (config is None or isinstance(config, str))
            or not isinstance(versions, list)
            or not all(isinstance(v, int) and 0 < v < 1 << 63 for v in versions)
            or not isinstance(token, int)
            or not 0 <= token < 1 << 63
            or not isinstance(keep, bool)
            or not isinstance(dependents, bool)
        ):
            return None
        return ControlCommand(
            body["op"],
            str(body["model"]),
            config,
            {str(k): bytes(v) for k, v in files.items()},
            tuple(sorted(set(versions))),
            str(body["id"]),
            token,
            keep_files=keep,
            dependents=dependents,
        )
    except (KeyError, TypeError, ValueError, AttributeError, msgpack.UnpackException):
        return None


REPLY_TTL_S = 300
"""An answer nobody collected (the sender gave up) is dropped after this long."""


def send_reply(client: Redis, keys: Keys, command_id: str, error: str | None) -> None:
    """Answer a command: ``{"error": null}`` when done, else the reason."""
    key = keys.control_reply(command_id)
    with client.pipeline(transaction=False) as pipe:
        pipe.rpush(key, orjson.dumps({"error": error}))
        pipe.expire(key, REPLY_TTL_S)
        pipe.execute()


def read_commands(
    client: Redis, stream: str, after: str, count: int = 16
) -> tuple[str, list[ControlCommand]]:
    """The commands on ``stream`` after entry ``after``, each deleted once read (one reader
    carries each out), and the id of the last entry read. Malformed entries are logged and
    dropped."""
    found = cast(list[Any], client.xread({stream: after}, count=count))
    commands: list[ControlCommand] = []
    for _, entries in found or []:
        for entry_id, fields in entries:
            after = entry_id.decode()
            client.xdel(stream, entry_id)
            command = decode_command(fields)
            if command is None:
                log.error("dropping a malformed control command %s", after)
            else:
                commands.append(command)
    return after, commands
