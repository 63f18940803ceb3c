"""The gateway's view of the control plane: models, versions and readiness.

Refreshed from Redis in the background (see :mod:`sluice.core.keys`), so that the
request path only reads local dictionaries.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import cast

from redis.asyncio import Redis

from sluice.core.catalog import UNLOADED, CatalogEntry, decode_entry
from sluice.core.clock import CLOCK
from sluice.core.errors import InvalidInput, NotFound, Unavailable
from sluice.core.keys import Keys, load_error_field
from sluice.core.on_demand import version_states
from sluice.core.queue_streams import with_tenants
from sluice.core.repository_namespaces import identifier
from sluice.core.wire import MalformedEntry
from sluice.gateway.control.routing_view import RoutingView

log = logging.getLogger(__name__)


class UnknownNamespacedModel(InvalidInput, NotFound):
    """A name the catalog does not hold while model namespacing is on: Triton looks every
    name up in its namespaces' map first, and answers a name it does not find there
    INVALID_ARG (400), not NOT_FOUND (core ``ModelRepositoryManager::FindModelIdentifier``),
    with the same words. Still a NotFound to the code that catches one: a request that
    misses catches up with the catalog, TorchServe's API answers its own 404, and readiness
    answers as without namespacing."""


class NoReadyVersion(NotFound):
    """A model of the repository none of whose versions is ready, its load failed, asked
    for without a version: Triton's NOT_FOUND "has no available versions" (core
    ``ModelLifeCycle::GetModel``). Readiness answers it "not ready"; TorchServe's
    predictions, unavailable."""


@dataclass
class CatalogView:
    keys: Keys
    models: dict[str, CatalogEntry] = field(default_factory=dict)
    ready: dict[str, frozenset[int]] = field(default_factory=dict)
    load_errors: dict[str, str] = field(default_factory=dict)
    depths: dict[tuple[str, int], int] = field(default_factory=dict)
    """Entries in each model version's streams (its tenants' too): its queue depth."""
    tenant_members: dict[tuple[str, int], list[str]] = field(default_factory=dict)
    """Each model version's tenant streams (:mod:`sluice.core.queue_streams`)."""
    hosts: dict[tuple[str, int], frozenset[str]] = field(default_factory=dict)
    """The hosts of each model version's live workers (:mod:`sluice.core.hosts`); a worker that
    has not said counts as an unknown host."""
    on_demand: dict[tuple[str, int], str] = field(default_factory=dict)
    """The state (``LOADING``, ``READY``) a live host reports of each on-demand version it
    holds (:mod:`sluice.core.on_demand`); a version not here is not loaded anywhere."""
    revision: bytes | None = None
    loaded: bool = False
    routing: RoutingView = field(default_factory=RoutingView)
    """Version labels and traffic splits (gateway.routing), refreshed beside the catalog."""
    namespacing: bool = False
    """Triton's model namespacing is on (``SLUICE_MODEL_NAMESPACING``): an unknown name is
    :class:`UnknownNamespacedModel`, and a known model is named by its namespace too
    (:meth:`identifier`)."""
    sole_repository: str = ""
    """With namespacing and one model repository: that repository, every model's namespace
    (the catalog records a model's repository only where several are joined)."""

    def only_on(self, model: str, version: int, host: str) -> bool:
        """Whether every live worker of the version is on ``host`` (and there is one)."""
        return self.hosts.get((model, version)) == frozenset((host,))

    async def refresh(self, redis: Redis) -> None:
        revision = cast(bytes | None, await redis.get(self.keys.catalog_revision))
        # No revision: nothing has published a catalog yet (the workers' `sluice up` may
        # start after this gateway: not loaded, so readiness stays false meanwhile), or
        # Redis restarted and it has not republished yet (keep serving the catalog we know
        # rather than answer 404s).
        if revision is not None and (revision != self.revision or not self.loaded):
            raw = cast(dict[bytes, bytes], await redis.hgetall(self.keys.catalog))
            models: dict[str, CatalogEntry] = {}
            for field_name, value in raw.items():
                try:
                    entry = decode_entry(value)
                except MalformedEntry as exc:
                    log.error("ignoring catalog entry %r: %s", field_name, exc)
                    continue
                models[entry.name] = entry
            self.models, self.revision, self.loaded = models, revision, True
        now = CLOCK.now()
        any_on_demand = any(entry.on_demand for entry in self.models.values())
        async with redis.pipeline(transaction=False) as pipe:
            pipe.hgetall(self.keys.load_errors)
            if any_on_demand:
                pipe.hgetall(self.keys.on_demand_states)
            order: list[tuple[str, int, int]] = []
            for entry in self.models.values():
                streams = self._streams(entry)
                for version in entry.versions:
                    pipe.zrangebyscore(self.keys.live_workers(entry.name, version), now, "+inf")
                    pipe.hgetall(self.keys.worker_hosts(entry.name, version))
                    # The tenant streams for the next refresh; those of the last one counted
                    # now (in the same round trip: a new tenant's stream counts one late).
                    pipe.smembers(self.keys.tenant_streams(entry.name, version))
                    names = with_tenants(
                        streams(version), self.tenant_members.get((entry.name, version), ())
                    )
                    for stream in names:
                        pipe.xlen(stream)
                    order.append((entry.name, version, len(names)))
            results = await pipe.execute()
        self.load_errors = {k.decode(): v.decode() for k, v in results[0].items()}
        self.on_demand = version_states(results[1], now) if any_on_demand else {}
        ready: dict[str, set[int]] = {}
        depths: dict[tuple[str, int], int] = {}
        hosts: dict[tuple[str, int], frozenset[str]] = {}
        members: dict[tuple[str, int], list[str]] = {}
        position = 2 if any_on_demand else 1
        for name, version, stream_count in order:
            live, advertised, tenants = results[position : position + 3]
            members[(name, version)] = sorted(_text(member) for member in tenants)
            if live:
                ready.setdefault(name, set()).add(version)
            hosts[(name, version)] = frozenset(
                advertised.get(worker, b"?").decode(errors="replace") for worker in live
            )
            first = position + 3
            depths[(name, version)] = sum(results[first : first + stream_count])
            position = first + stream_count
        self.ready = {name: frozenset(versions) for name, versions in ready.items()}
        self.depths = depths
        self.hosts = hosts
        self.tenant_members = members

    def _streams(self, entry: CatalogEntry) -> Callable[[int], list[str]]:
        levels = 0
        if entry.config is not None and entry.config.dynamic_batching is not None:
            levels = entry.config.dynamic_batching.priority_levels
        return lambda version: self.keys.request_streams(entry.name, version, levels)

    def streams(self, entry: CatalogEntry, version: int) -> list[str]:
        """A model version's request streams (the levels' base streams), highest priority
        first."""
        return self._streams(entry)(version)

    def tenant_streams(self, model: str, version: int, base: str) -> list[str]:
        """The tenants' streams of the level whose base stream is ``base``, as last read."""
        return with_tenants([base], self.tenant_members.get((model, version), ()))[1:]

    def entry(self, model: str) -> CatalogEntry:
        """The entry of the model clients name ``model``: NotFound for an unknown one (and
        for the internal name of a copy; with model namespacing, Triton's 400:
        :class:`UnknownNamespacedModel`), InvalidInput with Triton's words for a name
        several repositories hold."""
        entry = self.models.get(model)
        if entry is None or entry.listed_as:
            unknown = f"Request for unknown model: '{model}' is not found"
            raise UnknownNamespacedModel(unknown) if self.namespacing else NotFound(unknown)
        if entry.ambiguous:
            raise InvalidInput(entry.error or f"model '{model}' is ambiguous")
        return entry

    def listed_as(self, model: str) -> str:
        """The name the repository index lists ``model`` under (model namespacing: a
        copy's internal name is not)."""
        entry = self.models.get(model)
        return entry.listed_as if entry is not None and entry.listed_as else model

    def refuse_unloaded(self, model: str, entry: CatalogEntry) -> None:
        """With model namespacing, Triton's answer to a request naming a model of the
        repository that is not loaded (explicit model control), which it looks up in its map
        of namespaces first (core ``ModelRepositoryManager::FindModelIdentifier``): one never
        loaded is not there, an unknown name (400); one loaded once is, without a model
        (404). Without namespacing (or for another model) nothing: it is unavailable."""
        if not (self.namespacing and entry.error == UNLOADED and not entry.listed_as):
            return
        if entry.once_loaded:
            raise NotFound(f"Identifier of model '{model}' is not found in global map")
        raise UnknownNamespacedModel(f"Request for unknown model: '{model}' is not found")

    def namespace_of(self, entry: CatalogEntry) -> str:
        """The namespace of ``entry``'s model while namespacing is on (the repository it
        comes from), empty otherwise or where not known."""
        if not self.namespacing:
            return ""
        return entry.namespace or self.sole_repository

    def identifier(self, model: str, entry: CatalogEntry) -> str:
        """How Triton's texts name the model clients call ``model``: ``<namespace>::<name>``
        while namespacing is on, the name alone otherwise."""
        return identifier(self.namespace_of(entry), model)

    def load_error(self, model: str, version: int) -> str | None:
        return self.load_errors.get(load_error_field(model, version))

    def is_ready(self, model: str, version: int) -> bool:
        return version in self.ready.get(model, ())

    def route(
        self, model: str, version: str | None, label: str | None = None
    ) -> tuple[CatalogEntry, int]:
        """The version an inference request goes to: as :meth:`resolve`, except that a
        request naming no version follows the model's traffic split when it has one, as long
        as the version drawn is ready (else Triton's rule: the highest ready version)."""
        if version is None and label is None:
            drawn = self.routing.draw(model)
            if drawn is not None and drawn in self.ready.get(model, ()):
                entry = self.models.get(model)
                if entry is not None and entry.available and not entry.listed_as:
                    return entry, drawn
        return self.resolve(model, version, label)

    def mirror(self, model: str, chosen: int) -> int | None:
        """The ready version a request naming no version is mirrored to, if any."""
        shadow = self.routing.mirror(model, chosen)
        return shadow if shadow is not None and shadow in self.ready.get(model, ()) else None

    def resolve(
        self, model: str, version: str | None, label: str | None = None
    ) -> tuple[CatalogEntry, int]:
        """The entry and version a request addresses (by number, or by version ``label``);
        raises NotFound, Unavailable or InvalidInput with Triton's texts (core
        ``ModelRepositoryManager::GetModel``).

        A version with no live worker yet is served (the request waits in its queue);
        Triton would answer "not at ready state" there."""
        number = None if version is None else parse_version(version)
        entry = self.entry(model)
        self.refuse_unloaded(model, entry)
        if label is not None:
            number = self.routing.labelled(model, label)
        unknown = f"Request for unknown model: '{self.identifier(model, entry)}'"
        if not entry.available:
            detail = f"model '{model}' is unavailable: {entry.error}"
            if entry.error != UNLOADED:  # its load failed: Triton's answers, as below
                raise _not_served(unknown, number, entry.versions, detail)
            where = "has no available versions" if number is None else _not_ready(number)
            raise Unavailable(f"{unknown} {where}; {detail}")
        if label is not None and number not in entry.versions:
            raise Unavailable(
                f"model '{model}' version label '{label}' names version {number}, which is "
                "not served; it is unavailable"
            )
        if number is not None:
            if number not in entry.versions:
                raise NotFound(f"{unknown} version {number} is not found")
            error = self.load_error(model, number)
            if error is not None:
                raise Unavailable(f"{unknown} {_not_ready(number)}; it is unavailable: {error}")
            return entry, number
        ready = self.ready.get(model, frozenset())
        candidates = [v for v in entry.versions if v in ready] or [
            v for v in entry.versions if self.load_error(model, v) is None
        ]
        if not candidates:
            newest = entry.versions[-1]
            detail = f"version {newest} is unavailable: {self.load_error(model, newest)}"
            if entry.on_demand:  # (refused by the budget: 503, as the requests that waited)
                raise Unavailable(f"{unknown} has no available versions; {detail}")
            raise _not_served(unknown, None, entry.versions, detail)
        return entry, candidates[-1]

    def not_ready(self) -> list[str]:
        """What keeps the server from Triton's strict readiness: each model version that is
        not ready (unavailable, or no live worker yet), as ``'name'`` or ``'name' version N``."""
        waiting: list[str] = []
        for name in sorted(self.models):
            entry = self.models[name]
            if entry.error == UNLOADED or entry.ambiguous:
                continue  # explicit model control: readiness is about the loaded models
            shown = entry.listed_as or name
            if not entry.available:
                waiting.append(f"'{shown}' (unavailable)")
                continue
            for version in entry.versions:
                if entry.on_demand and self.load_error(name, version) is None:
                    continue  # takes requests, loaded or not
                if self.load_error(name, version) == UNLOADED:
                    continue  # (loaded, then let go as another version failed: as Triton)
                if not self.is_ready(name, version):
                    state = "unavailable" if self.load_error(name, version) else "loading"
                    waiting.append(f"'{shown}' version {version} ({state})")
        return waiting


_MAX_VERSION = (1 << 63) - 1


def parse_version(version: str) -> int:
    """A version from a URL, as Triton reads it: its routes take ``[0-9]+`` only (anything
    else is the 404 of an unknown path), then ``std::stol`` (leading zeros are fine; beyond
    int64 is a 400). Never ``int()`` on more digits than int64 has (``int()`` refuses more
    than 4,300 digits)."""
    if not (version.isascii() and version.isdigit()):
        raise NotFound(f"Not Found; model version '{version}' is not a number")
    digits = version.lstrip("0") or "0"
    if len(digits) > 19 or int(digits) > _MAX_VERSION:
        raise InvalidInput(
            f"failed to get model version from specified version string '{version}' "
            "(details: stol), version should be an integral value > 0"
        )
    return int(digits)


def _not_ready(version: int) -> str:
    return f"version {version} is not at ready state"


def _not_served(
    unknown: str, number: int | None, versions: tuple[int, ...], detail: str
) -> NotFound | Unavailable:
    """Triton's answer to a request for a model whose load failed (core
    ``ModelLifeCycle::GetModel``): without a version, NOT_FOUND "has no available versions";
    a version it tried, UNAVAILABLE "not at ready state"; any other, NOT_FOUND "is not
    found". Sluice's ``detail`` (why) follows."""
    if number is None:
        return NoReadyVersion(f"{unknown} has no available versions; {detail}")
    if number in versions:
        return Unavailable(f"{unknown} {_not_ready(number)}; {detail}")
    return NotFound(f"{unknown} version {number} is not found")


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
