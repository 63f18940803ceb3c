"""Byte sizes as operators write them, and the memory budgets of on-demand models.

``SLUICE_MEMORY_BUDGET=16GiB`` and ``SLUICE_GPU_MEMORY_BUDGET=0:70GiB,1:70GiB`` are read
here: a number with an optional unit (``B``, ``KB``/``MB``/``GB``/``TB`` powers of 1000,
``KiB``/``MiB``/``GiB``/``TiB`` powers of 1024; ``K``/``M``/``G``/``T`` alone are binary, as
Kubernetes' ``Ki`` and Docker's ``g`` are). Anything else is refused with the text and the
units it may use.
"""

from __future__ import annotations

import re

HOST = "host"
"""The device name of a host's own memory (a GPU's is :func:`gpu_device`)."""

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
    "k": 1024,
    "m": 1024**2,
    "g": 1024**3,
    "t": 1024**4,
    "ki": 1024,
    "mi": 1024**2,
    "gi": 1024**3,
    "ti": 1024**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*")
_MOST = 1 << 60
_LEAST = 1 << 20
"""No budget is larger than an exbibyte: a typo, not a machine."""
UNITS_HELP = "a number of bytes with an optional unit: B, KB, MB, GB, TB, KiB, MiB, GiB, TiB"


def parse_size(text: str, what: str) -> int:
    """Bytes from ``text`` (``"16GiB"``, ``"512 MB"``, ``"1000000"``); ValueError naming
    ``what`` and the units otherwise."""
    found = _SIZE.fullmatch(text) if len(text) <= 64 else None
    unit = _UNITS.get(found[2].lower()) if found else None
    if found is None or unit is None:
        raise ValueError(f"{what}: {text[:64]!r} is not a size ({UNITS_HELP})")
    size = int(float(found[1]) * unit)
    if size > _MOST:
        raise ValueError(f"{what}: {text[:64]!r} is more than an exbibyte")
    return size


def parse_gpu_budgets(text: str, what: str) -> dict[int, int]:
    """GPU index -> bytes from ``"0:70GiB,1:70GiB"``; ValueError naming the entry."""
    budgets: dict[int, int] = {}
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        index, sep, size = part.partition(":")
        if not sep or not index.strip().isdigit() or len(index.strip()) > 4:
            raise ValueError(f"{what}: {part[:64]!r} is not <GPU index>:<size> (as 0:70GiB)")
        gpu = int(index)
        if gpu in budgets:
            raise ValueError(f"{what}: GPU {gpu} is given twice")
        budgets[gpu] = parse_size(size, f"{what} of GPU {gpu}")
        if budgets[gpu] < _LEAST:  # (as the host's budget: 0 is a typo, not a budget)
            raise ValueError(f"{what} of GPU {gpu}: {size.strip()[:64]!r} is less than 1 MiB")
    return budgets


def gpu_device(index: int) -> str:
    """The device name of GPU ``index`` in budgets and footprints."""
    return f"gpu{index}"


def format_size(size: float) -> str:
    """``size`` bytes for people: ``1.5 GiB``, ``300 MiB``, ``12 KiB``, ``17 B``."""
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size >= scale:
            return f"{size / scale:.1f} {unit}".replace(".0 ", " ")
    return f"{int(size)} B"
