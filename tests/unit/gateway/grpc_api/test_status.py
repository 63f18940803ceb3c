"""The message of a failed call, cut to what a gRPC trailer can carry."""

from __future__ import annotations

import pytest

from sluice.gateway.grpc_api.status import MAX_DETAILS_BYTES, bounded


def _encoded_length(details: str) -> int:
    """Its length once percent-encoded, as gRPC sends a status's message."""
    return sum(1 if 0x20 <= byte <= 0x7E and byte != 0x25 else 3 for byte in details.encode())


@pytest.mark.parametrize("details", ["short", "a" * MAX_DETAILS_BYTES, "%" * 1365, "é" * 682])
def test_a_message_that_fits_is_kept(details: str) -> None:
    assert _encoded_length(details) <= MAX_DETAILS_BYTES
    assert bounded(details) == details


@pytest.mark.parametrize(
    "details", ["a" * (MAX_DETAILS_BYTES + 1), "%" * 2000, "é" * 5000, "x" * 4000 + "😀" * 50]
)
def test_a_longer_one_is_cut_saying_how_much_was_left_out(details: str) -> None:
    cut = bounded(details)
    assert _encoded_length(cut) <= MAX_DETAILS_BYTES
    kept = cut[: cut.rindex("... (")]
    assert details.startswith(kept)
    assert cut.endswith(f"... ({len(details) - len(kept)} more characters)")
