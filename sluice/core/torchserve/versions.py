"""TorchServe's model versions (the manifest's ``modelVersion``: ``"1.0"``, ``"2.0"``,
``"v1"``, any text) as Sluice's numbered version folders.

A whole version keeps its number (``"2.0"`` is version 2) while that number is free;
another (``"1.5"``, ``"v1"``, or ``"2"`` beside ``"2.0"``) takes the next free number, so
that no registration lays an archive over another version's. What each number stands for is
kept in the model's configuration, as the parameter ``torchserve.version.<number>``, beside
the archive it came from (``torchserve.url.<number>``) and the handler a registration named
instead of the manifest's (``torchserve.handler.<number>``), so that TorchServe's API shows
and accepts TorchServe's versions: ``/models/m/1.5`` finds the version registered as
``1.5``. As TorchServe keys a model's versions by their text, a version is named by its
exact text: ``2`` and ``2.0`` are two versions (:func:`find`).

TorchServe takes any text as a version. Sluice takes any text too, but as a version's text
goes into URLs, answers and metric labels (never into a file path: folders are numbered),
it refuses one longer than :data:`MAX_VERSION_CHARS` or holding a control character, a line
separator or a path separator (:func:`check_version`).
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Mapping
from dataclasses import dataclass
from decimal import Decimal

from sluice.core.errors import InvalidInput

VERSION_KEY = "torchserve.version."
URL_KEY = "torchserve.url."
HANDLER_KEY = "torchserve.handler."
RUNTIME_KEY = "torchserve.runtime."
_PER_VERSION = (VERSION_KEY, URL_KEY, HANDLER_KEY, RUNTIME_KEY)

_DECIMAL = re.compile(r"[0-9]{1,18}(\.[0-9]{1,18})?")

MAX_VERSION_CHARS = 128
"""The longest version text taken (TorchServe sets none; a model name has the same bound)."""
_SEPARATORS = frozenset("/\\")
_UNSAFE_CATEGORIES = frozenset({"Cc", "Cs", "Zl", "Zp"})
"""Control characters, lone surrogates (no UTF-8 can carry them) and line and paragraph
separators: none belongs in a URL, a log line or a metric label."""


@dataclass(frozen=True, slots=True)
class VersionRecord:
    """What a served version is to TorchServe's API."""

    version: str
    """TorchServe's version, as the manifest (or the registration) gave it."""
    url: str = ""
    """The archive it came from (a model store's file name, or a URL)."""
    handler: str = ""
    """A handler named at registration instead of the manifest's ("": the manifest's)."""
    runtime: str = ""

    def parameters(self, number: int) -> dict[str, str]:
        values = (self.version, self.url, self.handler, self.runtime)
        return {
            f"{key}{number}": value
            for key, value in zip(_PER_VERSION, values, strict=True)
            if value
        }


def decimal_of(text: str) -> Decimal | None:
    """A version's value (``"2"`` and ``"2.0"`` have one value, and are two versions: only
    the number a version takes reads its value); None when it is not a plain decimal
    number."""
    text = text.strip()
    return Decimal(text) if _DECIMAL.fullmatch(text) else None


def record_of(parameters: Mapping[str, str], number: int) -> VersionRecord:
    """What a served version is, from its model's parameters (a version laid out by hand,
    with none: ``"<number>.0"``)."""
    return VersionRecord(
        parameters.get(f"{VERSION_KEY}{number}") or f"{number}.0",
        parameters.get(f"{URL_KEY}{number}", ""),
        parameters.get(f"{HANDLER_KEY}{number}", ""),
        parameters.get(f"{RUNTIME_KEY}{number}", ""),
    )


def without_version(parameters: Mapping[str, str], number: int) -> dict[str, str]:
    """The parameters, less those of version ``number``."""
    own = {f"{key}{number}" for key in _PER_VERSION}
    return {key: value for key, value in parameters.items() if key not in own}


def find(text: str, served: Mapping[int, str]) -> int | None:
    """The number of the served version named ``text`` (``served``: number -> TorchServe's
    version), None if none. Versions are compared as text, as TorchServe compares them
    (its versions are the keys of a map of strings): ``2`` does not name ``2.0``."""
    for number, version in served.items():
        if version == text:
            return number
    return None


def check_version(version: str, where: str) -> None:
    """Refuse a version text that cannot travel safely in a URL, an answer or a metric
    label (TorchServe takes any text): longer than :data:`MAX_VERSION_CHARS`, or with a
    control character, a line separator or a path separator (``/`` would also make it
    unreachable in ``/models/{model}/{version}``). ``where`` names the archive."""
    if len(version) > MAX_VERSION_CHARS:
        raise InvalidInput(
            f"{where}: model version {version[:MAX_VERSION_CHARS]!r}... is longer than "
            f"{MAX_VERSION_CHARS} characters"
        )
    if any(c in _SEPARATORS or unicodedata.category(c) in _UNSAFE_CATEGORIES for c in version):
        raise InvalidInput(
            f"{where}: model version {version!r} holds a control character, a line "
            "separator or a path separator (/ or \\)"
        )


def number_for(version: str, served: Mapping[int, str], where: str) -> int:
    """The number a new version takes beside those ``served`` (number -> TorchServe's
    version; the caller has made sure ``version`` is not one of them): its own when it is
    a whole positive number and free, else the next free one. ``where`` names the archive in
    errors (:func:`check_version`)."""
    check_version(version, where)
    value = decimal_of(version)
    whole = value is not None and value > 0 and value == value.to_integral_value()
    if value is not None and whole and int(value) not in served:
        return int(value)
    return max(served, default=0) + 1
