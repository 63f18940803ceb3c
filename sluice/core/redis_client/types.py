"""Precise types for redis-py replies, whose own annotations are too loose to check against."""

from __future__ import annotations

StreamEntry = tuple[bytes, dict[bytes, bytes]]
"""(entry id, fields) of one stream entry."""

StreamRead = list[tuple[bytes, list[StreamEntry]]]
"""The reply of XREAD / XREADGROUP: (stream name, entries) per stream."""
