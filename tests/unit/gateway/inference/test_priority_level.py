"""Which priority level takes a request (:func:`sluice.gateway.inference.data_plane._priority`):
Triton's rules, a priority of 0 or past the model's levels taking its default level."""

from __future__ import annotations

import pytest

from sluice.core.config.model import DynamicBatching
from sluice.core.errors import InvalidInput
from sluice.gateway.inference.data_plane import _priority
from sluice.gateway.inference.request import InferRequest

LEVELS = DynamicBatching(priority_levels=3, default_priority_level=2)


def _asking(priority: object) -> InferRequest:
    return InferRequest("", [], [], {"priority": priority}, 1)


@pytest.mark.parametrize(("asked", "level"), [(1, 1), (3, 3), (0, 2), (4, 2), (2**63, 2)])
def test_a_priority_past_the_levels_takes_the_default_level_as_in_triton(
    asked: int, level: int
) -> None:
    assert _priority(_asking(asked), LEVELS) == level


def test_a_model_without_levels_takes_every_priority_on_its_one_stream() -> None:
    assert _priority(_asking(7), None) == 0
    assert _priority(_asking(7), DynamicBatching()) == 0


@pytest.mark.parametrize("asked", [-1, 1.5, "1", True])
def test_a_priority_that_is_not_a_non_negative_integer_is_refused(asked: object) -> None:
    with pytest.raises(InvalidInput, match="parameter 'priority'"):
        _priority(_asking(asked), LEVELS)
