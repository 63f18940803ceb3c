"""The gateway's copy of every model's labels and split, read from Redis in the background
refresh beside the catalog; requests only look them up here (a dictionary lookup, and one
random draw for a split)."""

from __future__ import annotations

import random
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import cast

from redis.asyncio import Redis

from sluice.core.errors import InvalidInput
from sluice.core.keys import Keys
from sluice.core.routing import Routing, Split, check_label, decode_routing


class UnknownLabel(InvalidInput):
    """A label the model does not have (as far as this process knows: see
    :func:`sluice.gateway.control.catalog_follow.asked_fresh`)."""


@dataclass
class RoutingView:
    models: dict[str, Routing] = field(default_factory=dict)
    splits: dict[str, Split] = field(default_factory=dict)
    rng: random.Random = field(default_factory=random.Random)

    async def refresh(self, redis: Redis, keys: Keys, models: Iterable[str]) -> None:
        """Every model's routing hash, in one round trip."""
        names = list(models)
        async with redis.pipeline(transaction=False) as pipe:
            for name in names:
                pipe.hgetall(keys.routing(name))
            results = cast(list[dict[bytes, bytes]], await pipe.execute())
        routings = {name: decode_routing(raw) for name, raw in zip(names, results, strict=True)}
        self.models = {name: routing for name, routing in routings.items() if _has_any(routing)}
        self.splits = _splits(self.models)

    def apply(self, model: str, routing: Routing) -> None:
        """A change this gateway made: seen by its next request, not its next refresh."""
        models = dict(self.models)
        models[model] = routing
        self.models, self.splits = models, _splits(models)

    def get(self, model: str) -> Routing:
        return self.models.get(model) or Routing()

    def labelled(self, model: str, label: str) -> int:
        """The version ``label`` names; 400 for a label the model does not have (as
        TensorFlow Serving answers: InvalidArgument)."""
        routing = self.models.get(model)
        version = routing.labels.get(label) if routing is not None else None
        if version is not None:
            return version
        check_label(label)
        known = ", ".join(sorted(routing.labels)) if routing is not None else ""
        raise UnknownLabel(
            f"Unrecognized servable version label: '{label}' is not a label of model "
            f"'{model}' (labels: {known or 'none'})"
        )

    def draw(self, model: str) -> int | None:
        """A version by the model's split weights; None without a split."""
        split = self.splits.get(model)
        return None if split is None else split.draw(self.rng)

    def mirror(self, model: str, chosen: int) -> int | None:
        """The version a request naming no version is also sent to (shadow traffic), drawn
        by its share; None for most requests (one lookup when the model has no shadow)."""
        routing = self.models.get(model)
        if routing is None or not routing.shadow:
            return None
        for version, percent in routing.shadow.items():
            if version != chosen and self.rng.randrange(100) < percent:
                return version
        return None


def _has_any(routing: Routing) -> bool:
    return bool(routing.labels or routing.weights or routing.shadow)


def _splits(models: dict[str, Routing]) -> dict[str, Split]:
    splits: dict[str, Split] = {}
    for name, routing in models.items():
        split = Split.of(routing.weights)
        if split is not None:
            splits[name] = split
    return splits
