"""Sizes as operators write them (SLUICE_MEMORY_BUDGET, SLUICE_GPU_MEMORY_BUDGET)."""

from __future__ import annotations

import pytest

from sluice.core.memory_budget import format_size, parse_gpu_budgets, parse_size


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("16GiB", 16 << 30),
        ("16 gib", 16 << 30),
        ("512MB", 512_000_000),
        ("1.5GiB", 3 << 29),
        ("1000000", 1_000_000),
        ("2G", 2 << 30),
        ("64Ki", 64 << 10),
        ("7b", 7),
    ],
)
def test_sizes_with_their_units(text: str, size: int) -> None:
    assert parse_size(text, "SLUICE_MEMORY_BUDGET") == size


@pytest.mark.parametrize("text", ["", "GiB", "12 parsecs", "-1GiB", "1e9", "0x10", "x" * 10_000])
def test_what_is_not_a_size_is_refused_naming_the_setting(text: str) -> None:
    with pytest.raises(ValueError, match=r"SLUICE_MEMORY_BUDGET: .* is not a size \(a number"):
        parse_size(text, "SLUICE_MEMORY_BUDGET")


def test_a_size_beyond_any_machine_is_refused() -> None:
    with pytest.raises(ValueError, match="more than an exbibyte"):
        parse_size("9999999TiB", "SLUICE_MEMORY_BUDGET")


def test_gpu_budgets_by_index() -> None:
    assert parse_gpu_budgets("0:70GiB, 1:35GiB", "B") == {0: 70 << 30, 1: 35 << 30}
    assert parse_gpu_budgets("", "B") == {}


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("70GiB", "is not <GPU index>:<size>"),
        ("a:1GiB", "is not <GPU index>:<size>"),
        ("0:1GiB,0:2GiB", "GPU 0 is given twice"),
        ("0:lots", "B of GPU 0: 'lots' is not a size"),
        ("0:0", "B of GPU 0: '0' is less than 1 MiB"),
        ("0:70GiB,1:0.5KiB", "B of GPU 1: '0.5KiB' is less than 1 MiB"),
    ],
)
def test_bad_gpu_budgets_name_the_entry(text: str, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        parse_gpu_budgets(text, "B")


def test_sizes_for_people() -> None:
    assert format_size(3 << 29) == "1.5 GiB"
    assert format_size(300 << 20) == "300 MiB"
    assert format_size(17) == "17 B"
