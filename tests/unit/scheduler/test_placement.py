from __future__ import annotations

from sluice.core.config import InstanceGroup
from sluice.core.placement import Placement, placements

CPU = Placement()


def test_no_group_is_one_cpu_instance() -> None:
    assert placements((), (0, 1)) == [CPU]


def test_gpu_group_without_gpus_spreads_over_visible_gpus() -> None:
    group = InstanceGroup("g", 2, "KIND_GPU")
    assert (
        placements((group,), (0, 1))
        == [Placement("KIND_GPU", 0)] * 2 + [Placement("KIND_GPU", 1)] * 2
    )


def test_listed_gpus_win_and_auto_follows_the_host() -> None:
    listed = InstanceGroup("g", 1, "KIND_GPU", (3,))
    auto = InstanceGroup("a", 1, "KIND_AUTO")
    assert placements((listed, auto), (0,)) == [Placement("KIND_GPU", 3), Placement("KIND_GPU", 0)]
    assert placements((auto,), ()) == [CPU]


def test_gpu_group_on_a_host_without_gpus_still_starts_to_report_the_reason() -> None:
    assert placements((InstanceGroup("g", 1, "KIND_GPU"),), ()) == [Placement("KIND_GPU", 0)]
