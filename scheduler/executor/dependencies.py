"""An ensemble's composing models in explicit model control, as Triton handles them: loading
an ensemble also loads the models it calls that are not loaded (before it, those of nested
ensembles first), and unloading it with ``unload_dependents`` also unloads the models it
calls that no other loaded model calls (after it).

The executor carries such a command out as a group of commands of its own, one per model
(:class:`Groups`); the client's command is answered once the whole group is done, or with
the first failure (the group's commands not yet begun are dropped then: an ensemble whose
composing model failed to load is not loaded either).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

from sluice.core.control import ControlCommand
from sluice.core.repository import RepositoryModel, composing_models

Lookup = Callable[[str], RepositoryModel | None]


def loads_first(
    command: ControlCommand, model: RepositoryModel, loaded: Mapping[str, object], lookup: Lookup
) -> list[ControlCommand]:
    """For the load of ``model`` (an ensemble): the loads of the models it calls that are
    not ``loaded``, then its own again; empty when there are none."""
    if model.config is None or not model.config.is_ensemble:
        return []
    missing = [name for name in composing_models(model.config, lookup) if name not in loaded]
    if not missing:
        return []
    again = replace(command, command_id=uuid.uuid4().hex)
    return [*(ControlCommand("load", name) for name in missing), again]


def unloads_after(
    command: ControlCommand, loaded: Mapping[str, RepositoryModel]
) -> list[ControlCommand]:
    """For an unload with ``dependents`` of a loaded ensemble: its own unload, then those of
    the loaded models it calls that no other loaded model calls; empty when there are none."""
    model = loaded.get(command.model)
    if not command.dependents or model is None or model.config is None:
        return []
    if not model.config.is_ensemble:
        return []
    calls = composing_models(model.config, loaded.get)
    keep: set[str] = set()
    for name, other in loaded.items():
        if name == command.model or name in calls or other.config is None:
            continue
        if other.config.is_ensemble:
            keep.update(composing_models(other.config, loaded.get))
    going = [name for name in calls if name not in keep]
    if not going:
        return []
    own = replace(command, command_id=uuid.uuid4().hex, dependents=False)
    return [own, *(ControlCommand("unload", name) for name in going)]


@dataclass
class _Group:
    command: ControlCommand
    """The client's command."""
    left: int


class Groups:
    """The executor's own commands that carry out one client's command together."""

    def __init__(self) -> None:
        self._of: dict[str, _Group] = {}

    def add(self, command: ControlCommand, parts: Sequence[ControlCommand]) -> None:
        group = _Group(command, len(parts))
        for part in parts:
            self._of[part.command_id] = group

    def owns(self, command: ControlCommand) -> bool:
        return command.command_id in self._of

    def settle(
        self, part: ControlCommand, error: str | None, queue: list[ControlCommand]
    ) -> tuple[ControlCommand, str | None] | None:
        """``part`` is done (``error``: it failed). The client's command and its answer once
        the group is done; None while parts are left. A failure ends the group: its parts
        still in ``queue`` are taken out of it."""
        group = self._of.pop(part.command_id)
        if error is not None:
            queue[:] = [c for c in queue if self._of.get(c.command_id) is not group]
            for command_id in [k for k, g in self._of.items() if g is group]:
                del self._of[command_id]
            if part.model != group.command.model:  # (one of the models it calls)
                error = f"failed to {group.command.op} '{group.command.model}', {error}"
            return group.command, error
        group.left -= 1
        return (group.command, None) if group.left == 0 else None
