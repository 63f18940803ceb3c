"""Triton's rate limiter, as configured: ``--rate-limit`` (``SLUICE_RATE_LIMIT``) turns it on,
``--rate-limit-resource=<name>:<count>[:<device>]`` (``SLUICE_RATE_LIMIT_RESOURCES``, comma
separated) says how many copies of a resource there are.

A resource an instance group lists in its ``rate_limiter`` exists once per device of each
host (a CPU instance counts as device 0), or once for the whole deployment when the model
configuration marks it ``global``. Its count is the one given for its device, else the one
given without a device, else, as in Triton, the most any instance that uses it needs (so
that every instance can execute). The workers hold them while a batch computes
(:mod:`sluice.workers.rate_limiter`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field

OFF, EXECUTION_COUNT = "off", "execution_count"
MODES = (OFF, EXECUTION_COUNT)

_NAME = re.compile(r"[^:,\s]+")


@dataclass(frozen=True, slots=True)
class ResourceCounts:
    """The counts given on the command line: ``(name, device)`` -> copies; device None: for
    every device (and for a global resource)."""

    counts: Mapping[tuple[str, int | None], int] = field(default_factory=dict)

    def given(self, name: str, device: int | None) -> int | None:
        """The count given for ``name`` on ``device`` (None: a global resource), or None."""
        if device is not None and (name, device) in self.counts:
            return self.counts[(name, device)]
        return self.counts.get((name, None))


def parse_resource_counts(text: str) -> ResourceCounts:
    """``R1:10,R2:5:0,R2:8:1``; a ValueError naming the bad entry."""
    counts: dict[tuple[str, int | None], int] = {}
    for entry in (part.strip() for part in text.split(",")):
        if not entry:
            continue
        parts = entry.split(":")
        if len(parts) not in (2, 3) or not _NAME.fullmatch(parts[0]):
            raise ValueError(f"{entry[:100]!r} is not <name>:<count> or <name>:<count>:<device>")
        name, count_text, *device_text = parts
        if not count_text.isdigit() or len(count_text) > 9:
            raise ValueError(f"{entry[:100]!r}: the count must be a whole number")
        if device_text and (not device_text[0].isdigit() or len(device_text[0]) > 4):
            raise ValueError(f"{entry[:100]!r}: the device must be a GPU number")
        device = int(device_text[0]) if device_text else None
        counts[(name, device)] = int(count_text)
    return ResourceCounts(counts)
