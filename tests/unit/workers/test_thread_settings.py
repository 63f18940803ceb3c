"""Compute threads: every core for the busy model by default, and the engines' thread
parameters from config.pbtxt as Triton's backends read them."""

from __future__ import annotations

from pathlib import Path

import pytest

from sluice.core.errors import InvalidConfig
from sluice.core.placement import Placement, threads_per_instance
from sluice.core.repository import read_model
from sluice.core.runtime import usable_cores
from sluice.workers.backends.onnxruntime_backend import SPINNING, session_options
from tests.support.onnx_models import write_identity


def _config(tmp_path: Path, parameters: dict[str, str]):  # type: ignore[no-untyped-def]
    extra = "\n".join(
        f'parameters {{ key: "{key}" value: {{ string_value: "{value}" }} }}'
        for key, value in parameters.items()
    )
    model = read_model(write_identity(tmp_path, "m", ["FP32"], extra=extra))
    assert model.config is not None, model.error
    return model.config


def test_a_models_instances_share_every_core_and_other_models_take_none() -> None:
    cores = usable_cores()
    assert threads_per_instance(1) == cores
    assert threads_per_instance(2) == max(1, cores // 2)
    assert threads_per_instance(10 * cores) == 1


def test_onnxruntime_defaults_every_core_and_no_spinning(tmp_path: Path) -> None:
    options = session_options(_config(tmp_path, {}), Placement(threads=0))
    assert options.intra_op_num_threads == usable_cores()  # type: ignore[attr-defined]
    assert options.inter_op_num_threads == 1  # type: ignore[attr-defined]
    assert options.get_session_config_entry(SPINNING) == "0"  # type: ignore[attr-defined]
    assert session_options(_config(tmp_path, {}), Placement(threads=3)).intra_op_num_threads == 3  # type: ignore[attr-defined]


def test_tritons_onnxruntime_parameters_win(tmp_path: Path) -> None:
    import onnxruntime as ort

    config = _config(
        tmp_path,
        {
            "intra_op_thread_count": "5",
            "inter_op_thread_count": "2",
            "execution_mode": "1",
            "enable_mem_arena": "0",
            "enable_mem_pattern": "0",
            SPINNING: "1",
        },
    )
    options = session_options(config, Placement(threads=1))
    assert options.intra_op_num_threads == 5  # type: ignore[attr-defined]
    assert options.inter_op_num_threads == 2  # type: ignore[attr-defined]
    assert options.execution_mode == ort.ExecutionMode.ORT_PARALLEL  # type: ignore[attr-defined]
    assert not options.enable_cpu_mem_arena  # type: ignore[attr-defined]
    assert not options.enable_mem_pattern  # type: ignore[attr-defined]
    assert options.get_session_config_entry(SPINNING) == "1"  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("parameters", "fragment"),
    [
        ({"intra_op_thread_count": "many"}, "'intra_op_thread_count' must be an integer"),
        ({"intra_op_thread_count": "-1"}, "from 0 to 1024"),
        ({"execution_mode": "2"}, "'execution_mode' must be an integer from 0 to 1"),
        ({"enable_mem_arena": "maybe"}, "'enable_mem_arena' must be 0 or 1"),
    ],
)
def test_bad_thread_parameters_name_the_parameter(
    tmp_path: Path, parameters: dict[str, str], fragment: str
) -> None:
    with pytest.raises(InvalidConfig, match=fragment):
        session_options(_config(tmp_path, parameters), Placement(threads=1))
