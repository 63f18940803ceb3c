"""Version labels and traffic splits of a model: what they are, how a client's are checked,
and how they are kept in Redis (one hash per model, :meth:`sluice.core.keys.Keys.routing`).

A label (``production``) names one version of a model; a split spreads the requests that
name no version over versions by integer weight (``{3: 90, 4: 10}``); a shadow mirrors a
share of those requests, in percent, to one more version, which computes them and answers
nobody (a rollout's shadow phase: ``{4: 100}``). Everything a client
sends here is checked before it is kept: label names, versions, weights, and counts.
"""

from __future__ import annotations

import bisect
import logging
import random
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from sluice.core.errors import InvalidInput

log = logging.getLogger(__name__)

LABEL_PATTERN = "[a-z0-9][a-z0-9_.-]{0,62}"
MAX_LABELS = 16
"""Labels a model may have."""
MAX_WEIGHT = 1000
HEADER = "Sluice-Version-Label"
"""Request header naming the label an inference request addresses."""
PARAMETER = "version_label"
"""Request parameter naming it (TensorFlow Serving's ``ModelSpec.version_label``)."""

_LABEL = re.compile(LABEL_PATTERN)
_LABEL_FIELD = "label:"
_WEIGHT_FIELD = "weight:"
_SHADOW_FIELD = "shadow:"


def weight_field(version: int) -> str:
    """The field of a version's split weight in a model's routing hash."""
    return f"{_WEIGHT_FIELD}{version}"


def shadow_field(version: int) -> str:
    """The field of a version's shadow share (percent) in a model's routing hash."""
    return f"{_SHADOW_FIELD}{version}"


_MAX_VERSION_DIGITS = 19


@dataclass(frozen=True, slots=True)
class Routing:
    """A model's labels (name -> version) and split weights (version -> weight)."""

    labels: Mapping[str, int] = field(default_factory=dict)
    weights: Mapping[int, int] = field(default_factory=dict)
    shadow: Mapping[int, int] = field(default_factory=dict)
    """Version -> share (percent) of the requests naming no version mirrored to it."""

    def to_json(self, model: str) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": model,
            "labels": dict(sorted(self.labels.items())),
            "weights": {str(v): w for v, w in sorted(self.weights.items())},
        }
        if self.shadow:
            body["shadow"] = {str(v): p for v, p in sorted(self.shadow.items())}
        return body


@dataclass(frozen=True, slots=True)
class Split:
    """Weighted choice between versions: one draw and one bisection per request."""

    versions: tuple[int, ...]
    bounds: tuple[int, ...]
    """Running totals of the weights; the last is the total."""

    @classmethod
    def of(cls, weights: Mapping[int, int]) -> Split | None:
        """None when no version has a weight above 0 (no split: Triton's rule)."""
        versions, bounds, total = [], [], 0
        for version, weight in sorted(weights.items()):
            if weight > 0:
                total += weight
                versions.append(version)
                bounds.append(total)
        return cls(tuple(versions), tuple(bounds)) if versions else None

    def draw(self, rng: random.Random) -> int:
        return self.versions[bisect.bisect_right(self.bounds, rng.randrange(self.bounds[-1]))]


def check_label(label: str, where: str = "version label") -> str:
    if not (isinstance(label, str) and _LABEL.fullmatch(label)):
        shown = repr(label)[:80]
        raise InvalidInput(f"{where} {shown} is not a valid label: it must match {LABEL_PATTERN}")
    return label


def requested_label(version: str | None, url_label: str | None, header: str | None) -> str | None:
    """The label an inference request names in its URL or its header (None: none).

    A request names its version one way: naming two different ones is refused."""
    if header is None:
        return url_label
    if version is not None:
        raise InvalidInput(
            f"header '{HEADER}' names label '{header[:64]}' but the URL names version {version}; "
            "name the version one way"
        )
    if url_label is not None and url_label != header:
        raise InvalidInput(
            f"header '{HEADER}' names label '{header[:64]}' but the URL names label "
            f"'{url_label}'; name the version one way"
        )
    return header


def parameter_label(value: Any, version: str | None, label: str | None) -> str | None:
    """The label of the request parameter ``version_label`` when it must be resolved now:
    None when the URL or the header named the same label already."""
    if not isinstance(value, str):
        raise InvalidInput(f"request parameter '{PARAMETER}' must be a string")
    if version is not None:
        raise InvalidInput(
            f"request parameter '{PARAMETER}' names label '{value[:64]}' but the URL names "
            f"version {version}; name the version one way"
        )
    if label is not None:
        if label != value:
            raise InvalidInput(
                f"request parameter '{PARAMETER}' names label '{value[:64]}' but the request "
                f"also names label '{label[:64]}'; name the version one way"
            )
        return None
    return value


def _version(raw: Any, where: str) -> int:
    digits = isinstance(raw, str) and raw.isascii() and raw.isdigit()
    if digits and len(raw.lstrip("0")) <= _MAX_VERSION_DIGITS:
        raw = int(raw)
    if not isinstance(raw, int) or isinstance(raw, bool) or not 0 < raw < 1 << 63:
        raise InvalidInput(f"{where} must be a model version (a positive integer)")
    return raw


def parse_labels(value: Any, served: tuple[int, ...], model: str) -> dict[str, int]:
    """``{"production": 3, ...}`` from a client, each version served by ``model``."""
    if not isinstance(value, dict):
        raise InvalidInput("'labels' must be an object of label name -> version")
    if len(value) > MAX_LABELS:
        raise InvalidInput(f"'labels' has {len(value)} labels; a model may have {MAX_LABELS}")
    labels: dict[str, int] = {}
    for name, raw in value.items():
        check_label(name, "'labels':")
        labels[name] = parse_version(raw, f"'labels.{name}'", served, model)
    return labels


def parse_version(raw: Any, where: str, served: tuple[int, ...], model: str) -> int:
    """A version given as a JSON integer, served by ``model``."""
    if not isinstance(raw, int) or isinstance(raw, bool):
        raise InvalidInput(f"{where} must be a model version (an integer)")
    return check_served(_version(raw, where), served, model)


def parse_weights(value: Any, served: tuple[int, ...], model: str) -> dict[int, int]:
    """``{"3": 90, "4": 10}`` from a client: versions served by ``model``, integer weights
    0..1000, at least one above 0 (an empty object clears the split)."""
    if not isinstance(value, dict):
        raise InvalidInput("'weights' must be an object of version -> weight")
    weights: dict[int, int] = {}
    for key, weight in value.items():
        where = f"'weights' key {repr(key)[:40]}"
        version = check_served(_version(key, where), served, model)
        if not isinstance(weight, int) or isinstance(weight, bool) or not 0 <= weight <= MAX_WEIGHT:
            raise InvalidInput(f"'weights.{version}' must be an integer from 0 to {MAX_WEIGHT}")
        if version in weights:
            raise InvalidInput(f"'weights' names version {version} twice")
        weights[version] = weight
    if weights and not any(weights.values()):
        raise InvalidInput("'weights' must give at least one version a weight above 0")
    return weights


def check_served(version: int, served: tuple[int, ...], model: str) -> int:
    if version not in served:
        listed = ", ".join(map(str, served)) or "none"
        raise InvalidInput(
            f"version {version} of model '{model}' is not served (served versions: {listed})"
        )
    return version


def encode_routing(routing: Routing) -> dict[str, str]:
    """The fields of the model's routing hash."""
    fields = {f"{_LABEL_FIELD}{name}": str(v) for name, v in routing.labels.items()}
    fields.update({f"{_WEIGHT_FIELD}{v}": str(w) for v, w in routing.weights.items()})
    fields.update({f"{_SHADOW_FIELD}{v}": str(p) for v, p in routing.shadow.items()})
    return fields


def decode_routing(raw: Mapping[bytes, bytes]) -> Routing:
    """A routing hash as read from Redis; fields that do not parse are logged and skipped."""
    labels: dict[str, int] = {}
    weights: dict[int, int] = {}
    shadow: dict[int, int] = {}
    for key, value in raw.items():
        try:
            name, number = key.decode(), int(value)
            if name.startswith(_LABEL_FIELD) and _LABEL.fullmatch(name[len(_LABEL_FIELD) :]):
                labels[name[len(_LABEL_FIELD) :]] = number
            elif name.startswith(_WEIGHT_FIELD) and 0 <= number <= MAX_WEIGHT:
                weights[int(name[len(_WEIGHT_FIELD) :])] = number
            elif name.startswith(_SHADOW_FIELD) and 0 <= number <= 100:
                shadow[int(name[len(_SHADOW_FIELD) :])] = number
            else:
                raise ValueError("unknown field")
        except ValueError as exc:  # (UnicodeDecodeError is one)
            log.error("ignoring routing field %r=%r: %s", key, value, exc)
    return Routing(labels, weights, shadow)
