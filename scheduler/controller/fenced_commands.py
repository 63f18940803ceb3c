"""How the leading controller's decisions reach Redis: fenced, and logged.

The controller decides; executors (``sluice up``) carry out. A load or unload the controller
decides becomes a command on the executors' control stream, appended in the same fenced
script that records the decision in ``Keys.controller_decisions``: a controller that no longer
holds the lease (paused, partitioned, replaced) cannot append anything. The command also
carries the fencing token, and an executor refuses a token older than one it has seen, so
even a command appended just before the lease changed hands is never carried out after the
successor's.

A rollout command the controller gives itself (poll mode's canary of a new version) stays in
memory and is handled on the next tick, as those gateways send.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import cast

import orjson
from redis import Redis

from sluice.core.catalog import CatalogEntry, decode_entry
from sluice.core.control import ControlCommand, encode_command
from sluice.core.keys import Keys
from sluice.core.repository import RepositoryModel
from sluice.core.rollout import OPS as ROLLOUT_OPS
from sluice.core.wire import MalformedEntry
from sluice.scheduler.controller.leadership import Lease, Write

log = logging.getLogger("sluice.scheduler.controller")

DECISIONS_KEPT = 10_000
"""The decision log is trimmed to its newest entries."""
COMMANDS_KEPT = 1000
"""The control stream is capped (approximately), as the gateways cap it."""

Served = dict[str, tuple[RepositoryModel, list[object]]]
"""Model name -> (the model as the catalog serves it, no local processes): the shape the
rollouts and the repository poller read."""


_decoded: dict[bytes, CatalogEntry] = {}
"""The catalog entries of the last read, by their encoded value: the leader reads the
catalog every tick, and decoding a model's configuration costs far more than comparing
bytes (an idle controller of a dozen models spent most of its time decoding)."""


def served_models(client: Redis, keys: Keys, repository: Path | None) -> Served:
    """The models the catalog in Redis serves (available, with versions), each with its
    directory in ``repository`` (the controller's copy) for the versions on disk."""
    global _decoded
    raw = cast(dict[bytes, bytes], client.hgetall(keys.catalog))
    served: Served = {}
    known, decoded = _decoded, {}
    for name_raw, value in raw.items():
        entry = known.get(value)
        if entry is None:
            try:
                entry = decode_entry(value)
            except MalformedEntry as exc:
                log.warning("skipping a catalog entry: %s", exc)
                continue
        decoded[value] = entry
        if not entry.available:
            continue
        name = name_raw.decode()
        path = (repository / name) if repository is not None else Path(name)
        served[name] = (RepositoryModel(name, path, entry.config, entry.versions), [])
    _decoded = decoded  # (one assignment: a reader on another thread sees either)
    return served


class CommandSender:
    """The leader's way to decide: fenced writes, commands to the executors, and its own
    rollout commands. Safe to call from the repository poller's thread."""

    def __init__(self, client: Redis, keys: Keys, lease: Lease) -> None:
        self.client, self.keys, self.lease = client, keys, lease
        self.loaded: Served = {}
        """The catalog as last read (the poller reads it from its thread)."""
        self._own: list[ControlCommand] = []
        self._lock = threading.Lock()
        self._count = 0

    def submit(self, command: ControlCommand) -> bool:
        """Decide ``command``: a load or unload goes to the executors; a rollout command
        waits for :meth:`own_commands`. False when this controller no longer leads."""
        if command.op in ROLLOUT_OPS:
            with self._lock:
                self._own.append(command)
            return True
        token = self.lease.token
        if token is None:
            return False
        command.token = token
        fields = encode_command(command)
        stream_args: tuple[str | bytes | int, ...] = ("MAXLEN", "~", COMMANDS_KEPT, "*")
        for name, value in fields.items():
            stream_args += (name, value)
        what = {"op": command.op, "model": command.model, "versions": list(command.versions)}
        return self.apply(
            [Write("XADD", self.keys.control_requests, stream_args)], what, command.command_id
        )

    def apply(self, writes: Sequence[Write], decision: Mapping[str, object], ref: str = "") -> bool:
        """Apply ``writes`` and log ``decision`` with them, fenced by the lease."""
        token = self.lease.token
        if token is None:
            return False
        with self._lock:
            self._count += 1
            count = self._count
        entry = {"token": token, "n": count, "time": time.time(), **decision}
        if ref:
            entry["id"] = ref
        log_writes = [
            Write("RPUSH", self.keys.controller_decisions, (orjson.dumps(entry),)),
            Write("LTRIM", self.keys.controller_decisions, (-DECISIONS_KEPT, -1)),
        ]
        if self.lease.apply([*writes, *log_writes]):
            return True
        log.warning("decision %s refused: token %d is no longer current", decision, token)
        return False

    def own_commands(self) -> list[ControlCommand]:
        """The rollout commands this controller gave itself since the last call."""
        with self._lock:
            commands, self._own = self._own, []
        return commands
