"""Model control carried out through ``sluice up`` (or the rollout controller): the part
of the model repository extension that REST, gRPC and TorchServe's management API share.

In Triton's default ``--model-control-mode=none`` load and unload are refused as Triton
refuses them (UNAVAILABLE); with ``sluice up --model-control-mode explicit`` a command goes
through Redis (:mod:`sluice.core.control`) and the caller waits until it is carried out.
"""

from __future__ import annotations

import asyncio

from sluice.core.control import NOT_ALLOWED, ControlCommand, await_answers, encode_command
from sluice.core.errors import InvalidInput, Unavailable
from sluice.gateway.state import GatewayState

_HINT = (
    "Sluice serves every model of its repository as it starts (Triton's "
    "--model-control-mode=none); change the repository and restart `sluice up` to load or "
    "unload a model"
)


NAMED_REPOSITORY = "'repository_name' specification is not supported"

_POLL_S = 0.05


async def require_explicit(state: GatewayState) -> None:
    """Load and unload are refused unless ``sluice up`` runs in explicit mode."""
    if not await state.control.explicit_model_control():
        raise Unavailable(f"{NOT_ALLOWED}; {_HINT}")


async def carry_out(state: GatewayState, command: ControlCommand, stream: str = "") -> None:
    """Hand the command to the executor (``sluice up``; ``stream``: another reader, such
    as the controller) and wait for it to be carried out (polling: the Redis client's
    socket timeout is shorter than a load may take, and loads are rare); raises
    InvalidInput with the reason when it failed."""
    keys = state.keys
    # A command carrying files (a registered archive: up to hundreds of MiB) is packed on
    # a thread, not on the event loop.
    fields = (
        await asyncio.to_thread(encode_command, command)
        if command.files
        else (encode_command(command))
    )
    # Every executor carries a load or unload out on its host; the controller alone
    # answers what goes to its stream.
    expected = frozenset() if stream else await state.control.live_executors()
    entry_id = await state.control.send_command(stream or keys.control_requests, fields)
    reply_key = keys.control_reply(command.command_id)
    answers = await await_answers(
        lambda: state.control.take_reply(reply_key),
        state.control.live_executors,
        expected,
        state.settings.model_control_timeout_s,
        _POLL_S,
    )
    if answers is None:
        if stream:
            # The controller took no command up (none leads): the client hears that it was
            # not carried out, so it must not be later, when a controller leads again. (An
            # executor's load may have begun: it goes on, as Triton's would.)
            await state.control.drop_command(stream, entry_id)
        raise Unavailable(
            f"the {command.op} of '{command.model}' did not finish within "
            f"{state.settings.model_control_timeout_s:.0f} s"
        )
    if not answers.waiting_for_others:  # (every executor has read it)
        await state.control.drop_command(stream or keys.control_requests, entry_id)
    # This gateway sees the change at once, the other gateway processes of this host
    # before their next request (the counter), other hosts' within a refresh.
    await state.control.refresh_catalog(state.view)
    await state.control.refresh_routing(state.view)
    state.host_changes.bump()
    if answers.error:
        raise InvalidInput(answers.error)
