"""Load and unload with model namespacing (:mod:`sluice.core.repository_namespaces`), as
Triton carries them out: a load or unload naming a name several repositories hold applies
to every copy (each an ensemble's composing models with it, as a load of that copy would),
and a configuration sent with the load applies to each copy. The copies' internal names
are Sluice's own: a client's command naming one is answered as for a model no repository
holds.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Mapping
from dataclasses import replace

from sluice.core.control import ControlCommand
from sluice.core.repository import RepositoryModel
from sluice.core.repository_namespaces import Namespaces
from sluice.scheduler.executor.dependencies import loads_first, unloads_after

Lookup = Callable[[str], RepositoryModel | None]


def internal_named(command: ControlCommand, namespaces: Namespaces | None) -> bool:
    """Whether a client's ``command`` names a copy by its internal name (a controller's
    commands, which carry a fencing token, may: poll mode loads each copy)."""
    return namespaces is not None and not command.token and namespaces.is_internal(command.model)


def on_each_copy(
    command: ControlCommand,
    namespaces: Namespaces | None,
    loaded: Mapping[str, RepositoryModel],
    lookup: Lookup,
) -> list[ControlCommand]:
    """The commands carrying ``command`` out on each copy of its model, in the
    repositories' order (an ensemble's composing models loaded before it, or unloaded
    after it with ``dependents``), each model once; empty when its model is not a name
    several repositories hold. A model ``loaded`` under the name itself (loaded while one
    repository held it) is unloaded last: the copies replace it."""
    copies = namespaces.copies(command.model) if namespaces is not None else ()
    if not copies:
        return []
    parts: list[ControlCommand] = []
    for copy in copies:
        part = replace(
            command,
            model=copy,
            command_id=uuid.uuid4().hex,
            config=_unnamed(command.config),
        )
        if command.op == "load":
            model = lookup(copy)
            parts += (loads_first(part, model, loaded, lookup) if model else []) or [part]
        else:
            parts += unloads_after(part, loaded) or [part]
    if command.model in loaded:
        own = ControlCommand("unload", command.model, dependents=command.dependents)
        parts += unloads_after(own, loaded) or [own]
    done: set[tuple[str, str]] = set()
    unique: list[ControlCommand] = []
    for part in parts:
        if (part.op, part.model) not in done:
            done.add((part.op, part.model))
            unique.append(part)
    return unique


def _unnamed(config: str | None) -> str | None:
    """A load's configuration without the model's name, which names the copies together
    (each is read as its own repository's model; one that is not a JSON object is left as
    it is, for the load to refuse)."""
    if config is None:
        return None
    try:
        document = json.loads(config)
    except ValueError:
        return config
    if not isinstance(document, dict) or "name" not in document:
        return config
    document.pop("name")
    return json.dumps(document)
