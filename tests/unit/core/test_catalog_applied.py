"""Catalog revisions as Redis holds them and gateways report them: decimal integers that
only grow, compared as numbers (``"10"`` is later than ``"9"``)."""

from __future__ import annotations

import pytest

from sluice.core.catalog_applied import revision_number


@pytest.mark.parametrize(
    ("raw", "number"),
    [
        (b"9", 9),
        (b"10", 10),
        ("1712345678901234", 1712345678901234),  # (started again from Redis's clock, in µs)
        (42, 42),
        (None, None),
        (b"", None),
        (b"-3", None),
        (b"1e5", None),
        (b" 7", None),
        (b"\xff", None),
        ("\u0663", None),  # (a digit to str.isdigit, not a revision)
        (b"9" * 400, None),
    ],
)
def test_revisions_are_read_as_numbers_and_anything_else_as_none(
    raw: bytes | str | int | None, number: int | None
) -> None:
    assert revision_number(raw) == number
    assert revision_number(b"10") > revision_number(b"9")  # type: ignore[operator]
