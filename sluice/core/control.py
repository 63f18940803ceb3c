"""Model control commands: Triton's load / unload (gateways and the controller to the
executors, ``sluice up``) and rollouts (gateways to the leading controller).

The sender appends a command to a stream and waits for the answers on a list of the
command's own (``Keys.control_reply``): ``{"error": null}`` when done, else the error. Every
executor of the deployment (one per host) reads every command, with a cursor of its own,
and carries it out on its host; each one alive keeps its place in ``Keys.executors``, and
the sender waits for the answer of each executor that was alive when it sent the command
(and still is): :class:`Answers`. Commands the controller sends carry its fencing token: an
executor refuses a command whose token is older than one it has already seen, so a deposed
leader's late command is never carried out after its successor's.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass, field
from typing import Any, cast

import msgpack
import orjson
from redis import Redis
from redis.asyncio import Redis as AsyncRedis

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
            or not all(isinstance(k, str) and isinstance(v, bytes) for k, v in files.items())
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
            files,
            tuple(sorted(set(versions))),
            str(body["id"]),
            token,
            keep_files=keep,
            dependents=dependents,
        )
    except (KeyError, TypeError, ValueError, AttributeError, msgpack.UnpackException):
        return None


REPLY_TTL_S = 300
"""An answer nobody collected (the sender gave up) is dropped after this long; so is a
command every executor has read (they trim the stream)."""

EXECUTOR_TTL_S = 6
"""An executor renews its place in ``Keys.executors`` every third of this."""

REGISTER_EXECUTOR = """
local now = tonumber(redis.call('TIME')[1])
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - 60)
return 0
"""
"""``KEYS[1]``: ``Keys.executors``; ``ARGV``: the executor's id, its time to live (s). On
Redis's clock, so hosts whose clocks disagree agree on who is alive."""

LIVE_EXECUTORS = """
return redis.call('ZRANGEBYSCORE', KEYS[1], tonumber(redis.call('TIME')[1]), '+inf')
"""
"""``KEYS[1]``: ``Keys.executors``; the ids of the executors alive now."""


def send_reply(
    client: Redis, keys: Keys, command_id: str, error: str | None, executor: str = ""
) -> None:
    """Answer a command: ``{"error": null}`` when done, else the reason; ``executor``: who
    answers (an executor's id)."""
    key = keys.control_reply(command_id)
    with client.pipeline(transaction=False) as pipe:
        pipe.rpush(key, orjson.dumps({"error": error, "executor": executor}))
        pipe.expire(key, REPLY_TTL_S)
        pipe.execute()


def read_commands(
    client: Redis, stream: str, after: str, count: int = 16
) -> tuple[str, list[ControlCommand]]:
    """The commands on ``stream`` after entry ``after`` (every executor reads them all), and
    the id of the last entry read. Malformed entries are logged and dropped."""
    found = cast(list[Any], client.xread({stream: after}, count=count))
    commands: list[ControlCommand] = []
    for _, entries in found or []:
        for entry_id, fields in entries:
            after = entry_id.decode()
            command = decode_command(fields)
            if command is None:
                log.error("dropping a malformed control command %s", after)
            else:
                commands.append(command)
    return after, commands


def newest_command(client: Redis, stream: str) -> str:
    """The id of ``stream``'s newest entry ("0-0" for none): where an executor that starts
    begins reading (commands sent before it ran were answered by others, or given up)."""
    newest = cast(list[Any], client.xrevrange(stream, count=1))
    return cast(bytes, newest[0][0]).decode() if newest else "0-0"


def trim_commands(client: Redis, stream: str) -> None:
    """Drop the commands older than :data:`REPLY_TTL_S` (their senders have given up)."""
    seconds, _ = client.time()
    client.xtrim(stream, minid=f"{(int(seconds) - REPLY_TTL_S) * 1000}-0", approximate=True)


@dataclass
class Answers:
    """The answers to one command. ``expected``: the executors alive when it was sent (none
    registered: the first answer settles it, as a lone executor's would)."""

    expected: frozenset[str]
    replied: set[str] = field(default_factory=set)
    error: str | None = None
    """The first failure answered (the command failed on that executor's host)."""
    answered: bool = False

    def add(self, raw: bytes) -> None:
        """One answer, as :func:`send_reply` wrote it (a malformed one counts as a failure)."""
        self.answered = True
        try:
            answer = orjson.loads(raw)
            error, executor = answer.get("error"), str(answer.get("executor") or "")
        except (orjson.JSONDecodeError, AttributeError):
            error, executor = "a malformed answer", ""
        self.replied.add(executor)
        if error and self.error is None:
            self.error = str(error)

    def complete(self, alive: Collection[str]) -> bool:
        """Whether every expected executor that is still ``alive`` has answered."""
        if not self.answered:
            return False
        return not (self.expected & frozenset(alive)) - self.replied

    @property
    def waiting_for_others(self) -> bool:
        """Whether an answer came but others are expected (check who is alive then)."""
        return self.answered and bool(self.expected - self.replied)


def live_executors(client: Redis, keys: Keys) -> frozenset[str]:
    """The executors alive now."""
    found = cast(list[bytes], client.eval(LIVE_EXECUTORS, 1, keys.executors))
    return frozenset(m.decode() for m in found)


async def live_executors_async(redis: AsyncRedis, keys: Keys) -> frozenset[str]:
    found = await cast(Awaitable[list[bytes]], redis.eval(LIVE_EXECUTORS, 1, keys.executors))
    return frozenset(m.decode() for m in found)


async def await_answers(
    take: Callable[[], Awaitable[bytes | None]],
    alive: Callable[[], Awaitable[frozenset[str]]],
    expected: frozenset[str],
    timeout_s: float,
    poll_s: float,
) -> Answers | None:
    """Poll for a command's answers (``take``: the next one, if any) until each expected
    executor still ``alive`` has answered; None when that did not happen in ``timeout_s``."""
    answers = Answers(expected)
    deadline = time.monotonic() + timeout_s
    checked_alive = 0.0
    while time.monotonic() < deadline:
        raw = await take()
        if raw is not None:
            answers.add(raw)
            if not answers.waiting_for_others:
                return answers
            continue
        if answers.waiting_for_others and time.monotonic() - checked_alive >= 1.0:
            checked_alive = time.monotonic()
            if answers.complete(await alive()):
                return answers
        await asyncio.sleep(poll_s)
    return None
