from __future__ import annotations

from pathlib import Path

import onnx
import pytest
from onnx import TensorProto, helper

from sluice.core.config import TensorSpec, VersionPolicy
from sluice.core.errors import InvalidConfig
from sluice.core.repository import RepositoryModel, config_source, read_model, scan_repository

IDENTITY_CONFIG = """
platform: "onnxruntime_onnx"
max_batch_size: 8
input { name: "x" data_type: TYPE_FP32 dims: [4] }
output { name: "y" data_type: TYPE_FP32 dims: [4] }
"""


def _write_onnx(path: Path, first_dim: int | str = "batch") -> Path:
    graph = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["y"])],
        "identity",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [first_dim, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [first_dim, 4])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))
    return path


def _model(root: Path, name: str, config: str | None, versions: tuple[str, ...] = ("1",)) -> Path:
    model_dir = root / name
    model_dir.mkdir(parents=True)
    if config is not None:
        (model_dir / "config.pbtxt").write_text(config)
    for version in versions:
        _write_onnx(model_dir / version / "model.onnx")
    return model_dir


def _usable(model: RepositoryModel) -> None:
    assert model.error is None, model.error
    assert model.config is not None
    assert model.usable


def test_scan_sorted_with_broken_model_among_good_ones(tmp_path: Path) -> None:
    _model(tmp_path, "zeta", IDENTITY_CONFIG)
    _model(tmp_path, "alpha", IDENTITY_CONFIG, versions=("1", "2"))
    _model(tmp_path, "broken", "max_batch_size: 8\ninput {{{")
    _model(tmp_path, ".hidden", IDENTITY_CONFIG)
    (tmp_path / "README.md").write_text("not a model")

    models = scan_repository(tmp_path)
    assert [m.name for m in models] == ["alpha", "broken", "zeta"]
    alpha, broken, zeta = models
    _usable(alpha)
    _usable(zeta)
    assert alpha.versions == (2,)
    assert alpha.path == tmp_path / "alpha"
    assert alpha.model_file(2) == tmp_path / "alpha" / "2" / "model.onnx"
    assert zeta.config is not None and zeta.config.name == "zeta"

    assert not broken.usable
    assert broken.config is None
    assert broken.versions == ()
    assert broken.error is not None
    assert broken.error.startswith("config.pbtxt: line 2")
    with pytest.raises(InvalidConfig):
        broken.model_file(1)


def test_scan_missing_root(tmp_path: Path) -> None:
    with pytest.raises(InvalidConfig, match="does not exist"):
        scan_repository(tmp_path / "nope")
    (tmp_path / "file").write_text("")
    with pytest.raises(InvalidConfig, match="not a directory"):
        scan_repository(tmp_path / "file")


def test_empty_repository(tmp_path: Path) -> None:
    assert scan_repository(tmp_path) == []


def test_missing_version_directory(tmp_path: Path) -> None:
    model_dir = _model(tmp_path, "m", IDENTITY_CONFIG, versions=())
    (model_dir / "latest").mkdir()
    model = read_model(model_dir)
    assert model.config is None
    assert model.error is not None and "no version directory" in model.error


def test_non_numeric_version_dirs_ignored(tmp_path: Path) -> None:
    model_dir = _model(tmp_path, "m", IDENTITY_CONFIG, versions=("1", "3"))
    for ignored in ("v7", "09", "0", "12a"):
        _write_onnx(model_dir / ignored / "model.onnx")
    (model_dir / "99").write_text("a file, not a folder")
    model = read_model(model_dir)
    _usable(model)
    assert model.versions == (3,)


@pytest.mark.parametrize(
    ("policy", "expected"),
    [
        ("", (10,)),
        ("version_policy { latest { num_versions: 2 } }", (3, 10)),
        ("version_policy { latest { num_versions: 5 } }", (1, 2, 3, 10)),
        ("version_policy { all { } }", (1, 2, 3, 10)),
        ("version_policy { specific { versions: [3, 1] } }", (1, 3)),
    ],
)
def test_version_policies(tmp_path: Path, policy: str, expected: tuple[int, ...]) -> None:
    model_dir = _model(tmp_path, "m", IDENTITY_CONFIG + policy, versions=("1", "2", "3", "10"))
    model = read_model(model_dir)
    _usable(model)
    assert model.versions == expected


def test_specific_version_that_does_not_exist(tmp_path: Path) -> None:
    model_dir = _model(
        tmp_path,
        "m",
        IDENTITY_CONFIG + "version_policy { specific { versions: [1, 4] } }",
        versions=("1", "2"),
    )
    model = read_model(model_dir)
    assert model.config is None
    assert model.error is not None and "version 4" in model.error


def test_missing_model_file_in_selected_version(tmp_path: Path) -> None:
    model_dir = _model(
        tmp_path, "m", IDENTITY_CONFIG + "version_policy { all { } }", versions=("1",)
    )
    (model_dir / "2").mkdir()
    model = read_model(model_dir)
    assert model.config is None
    assert model.error == "model file m/2/model.onnx is missing"


def test_unselected_version_without_model_file_is_fine(tmp_path: Path) -> None:
    model_dir = _model(tmp_path, "m", IDENTITY_CONFIG, versions=("2",))
    (model_dir / "1").mkdir()
    model = read_model(model_dir)
    _usable(model)
    assert model.versions == (2,)


def test_autocomplete_without_config(tmp_path: Path) -> None:
    model_dir = _model(tmp_path, "auto", None, versions=("1", "2"))
    model = read_model(model_dir)
    _usable(model)
    assert model.config is not None
    assert model.versions == (2,)
    assert model.config.platform == "onnxruntime_onnx"
    assert model.config.max_batch_size == 4
    assert model.config.inputs == (TensorSpec("x", "FP32", (4,)),)
    assert model.config.outputs == (TensorSpec("y", "FP32", (4,)),)
    assert model.config.version_policy == VersionPolicy()


@pytest.mark.parametrize(("default", "batcher"), [(0, False), (1, False), (16, True)])
def test_autocomplete_takes_the_deployments_default_max_batch_size(
    tmp_path: Path, default: int, batcher: bool
) -> None:
    """Triton's --backend-config=default-max-batch-size: 0 leaves a model that can batch
    without batching; over 1 it batches with the dynamic batcher, in the scan and in a
    single read (an ensemble's, a worker's) alike."""
    _model(tmp_path, "auto", None)
    [scanned] = scan_repository(tmp_path, default_max_batch_size=default)
    read = read_model(tmp_path / "auto", default_max_batch_size=default)
    for model in (scanned, read):
        assert model.config is not None
        assert model.config.max_batch_size == default
        assert (model.config.dynamic_batching is not None) is batcher
        dims = [4] if default else [-1, 4]
        assert model.config.raw["input"][0]["dims"] == dims


def test_missing_config_without_onnx(tmp_path: Path) -> None:
    model_dir = tmp_path / "m"
    (model_dir / "1").mkdir(parents=True)
    (model_dir / "1" / "model.pt").write_bytes(b"weights")
    model = read_model(model_dir)
    assert model.error == "config.pbtxt is missing and the model cannot be auto-completed"


def test_config_without_io_is_autocompleted(tmp_path: Path) -> None:
    model_dir = _model(
        tmp_path,
        "m",
        'backend: "onnxruntime"\nmax_batch_size: 2\ninstance_group { count: 3 kind: KIND_CPU }',
    )
    model = read_model(model_dir)
    _usable(model)
    assert model.config is not None
    assert model.config.max_batch_size == 2
    assert model.config.total_instances == 3
    assert model.config.inputs == (TensorSpec("x", "FP32", (4,)),)
    assert model.config.raw["output"][0]["dims"] == [4]


def test_autocomplete_uses_newest_selected_version(tmp_path: Path) -> None:
    model_dir = _model(
        tmp_path,
        "m",
        'platform: "onnxruntime_onnx"\nversion_policy { specific { versions: [1] } }',
        versions=("1",),
    )
    # Version 2 exists but is not selected; its model is broken.
    (model_dir / "2").mkdir()
    (model_dir / "2" / "model.onnx").write_bytes(b"garbage")
    model = read_model(model_dir)
    _usable(model)
    assert model.versions == (1,)


def test_config_with_fixed_batch_model_is_unavailable(tmp_path: Path) -> None:
    model_dir = tmp_path / "m"
    _write_onnx(model_dir / "1" / "model.onnx", first_dim=1)
    (model_dir / "config.pbtxt").write_text('platform: "onnxruntime_onnx"\nmax_batch_size: 4')
    model = read_model(model_dir)
    assert model.error is not None and "max_batch_size is 4" in model.error


def test_corrupt_model_is_unavailable(tmp_path: Path) -> None:
    model_dir = tmp_path / "m"
    (model_dir / "1").mkdir(parents=True)
    (model_dir / "1" / "model.onnx").write_bytes(b"\x08\xff\xff garbage")
    model = read_model(model_dir)
    assert model.error is not None and "cannot read the ONNX model" in model.error


def test_platform_inferred_from_model_file(tmp_path: Path) -> None:
    model_dir = _model(tmp_path, "m", "max_batch_size: 8")
    model = read_model(model_dir)
    _usable(model)
    assert model.config is not None
    assert model.config.platform == "onnxruntime_onnx"
    assert model.config.backend == "onnxruntime"
    assert model.config.default_model_filename == "model.onnx"
    assert model.config.raw["platform"] == "onnxruntime_onnx"
    assert len(model.config.inputs) == 1


def test_platform_cannot_be_inferred(tmp_path: Path) -> None:
    model_dir = tmp_path / "m"
    (model_dir / "1").mkdir(parents=True)
    (model_dir / "1" / "weights.bin").write_bytes(b"")
    (model_dir / "config.pbtxt").write_text("max_batch_size: 1")
    model = read_model(model_dir)
    assert model.error is not None and "neither platform nor backend" in model.error


def test_name_mismatch_is_reported(tmp_path: Path) -> None:
    model_dir = _model(tmp_path, "bar", 'name: "foo"\n' + IDENTITY_CONFIG)
    model = read_model(model_dir)
    assert model.error == ("config.pbtxt: name 'foo' does not match the model directory 'bar'")


def test_custom_backend_with_own_file(tmp_path: Path) -> None:
    model_dir = tmp_path / "py"
    (model_dir / "1").mkdir(parents=True)
    (model_dir / "1" / "model.py").write_text("class TritonPythonModel: ...\n")
    (model_dir / "config.pbtxt").write_text(
        'backend: "python"\n'
        'input { name: "a" data_type: TYPE_STRING dims: [1] }\n'
        'output { name: "b" data_type: TYPE_STRING dims: [1] }\n'
    )
    model = read_model(model_dir)
    _usable(model)
    assert model.model_file(1) == model_dir / "1" / "model.py"


STREAM_CONFIG = """
backend: "python"
max_batch_size: 8
input { name: "x" data_type: TYPE_FP32 dims: [4] }
output { name: "y" data_type: TYPE_FP32 dims: [4] }
model_transaction_policy { decoupled: true }
"""


def _ensemble(root: Path, name: str, step: str, *, says_decoupled: bool = False) -> None:
    policy = "model_transaction_policy { decoupled: true }" if says_decoupled else ""
    (root / name / "1").mkdir(parents=True)
    (root / name / "config.pbtxt").write_text(
        f"""
        platform: "ensemble"
        max_batch_size: 8
        input {{ name: "x" data_type: TYPE_FP32 dims: [4] }}
        output {{ name: "y" data_type: TYPE_FP32 dims: [4] }}
        ensemble_scheduling {{ step {{ model_name: "{step}" model_version: -1
          input_map {{ key: "x" value: "x" }} output_map {{ key: "y" value: "y" }} }} }}
        {policy}
        """
    )


def test_an_ensemble_is_decoupled_exactly_when_a_composing_model_is(tmp_path: Path) -> None:
    """As Triton fills in an ensemble's transaction policy: whatever its config says."""
    (tmp_path / "stream" / "1").mkdir(parents=True)
    (tmp_path / "stream" / "1" / "model.py").write_text("class Model: ...\n")
    (tmp_path / "stream" / "config.pbtxt").write_text(STREAM_CONFIG)
    _model(tmp_path, "plain", IDENTITY_CONFIG)
    _ensemble(tmp_path, "streaming", "stream")
    _ensemble(tmp_path, "nested", "streaming")
    _ensemble(tmp_path, "one_answer", "plain", says_decoupled=True)
    _ensemble(tmp_path, "orphan", "ghost")
    scanned = {model.name: model for model in scan_repository(tmp_path)}
    decoupled = {name: m.config.decoupled for name, m in scanned.items() if m.config}
    assert decoupled == {
        "stream": True,
        "plain": False,
        "streaming": True,
        "nested": True,
        "one_answer": False,
        "orphan": False,
    }
    for name in ("streaming", "nested", "one_answer"):  # one model read alone agrees
        alone = read_model(tmp_path / name).config
        assert alone is not None and alone.decoupled == decoupled[name]
    streaming = scanned["streaming"].config
    assert streaming is not None
    assert streaming.raw["model_transaction_policy"] == {"decoupled": True}


def test_a_custom_configuration_is_read_where_the_model_has_one(tmp_path: Path) -> None:
    """Triton's --model-config-name: configs/<name>.pbtxt instead of config.pbtxt, for the
    models that have it; the others (and an unset name) read config.pbtxt."""
    tuned = _model(tmp_path, "tuned", IDENTITY_CONFIG)
    (tuned / "configs").mkdir()
    (tuned / "configs" / "h100.pbtxt").write_text(
        IDENTITY_CONFIG.replace("max_batch_size: 8", "max_batch_size: 2")
    )
    (tuned / "configs" / "broken.pbtxt").write_text("max_batch_size: x\n")
    _model(tmp_path, "plain", IDENTITY_CONFIG)
    assert config_source(tuned, "h100") == "configs/h100.pbtxt"
    assert config_source(tuned, "a100") == config_source(tuned) == "config.pbtxt"
    by_name = {m.name: m for m in scan_repository(tmp_path, "h100")}
    assert by_name["tuned"].config is not None and by_name["tuned"].config.max_batch_size == 2
    assert by_name["plain"].config is not None and by_name["plain"].config.max_batch_size == 8
    default = read_model(tuned)
    assert default.config is not None and default.config.max_batch_size == 8
    broken = read_model(tuned, "broken")
    assert broken.config is None
    assert broken.error is not None and broken.error.startswith("configs/broken.pbtxt: line 1")


def test_a_custom_configuration_may_complete_from_the_model_file(tmp_path: Path) -> None:
    """A custom configuration is completed from the ONNX file like config.pbtxt is; a model
    with no config.pbtxt at all can have one."""
    model_dir = _model(tmp_path, "m", None)
    (model_dir / "configs").mkdir()
    (model_dir / "configs" / "cpu.pbtxt").write_text(
        'platform: "onnxruntime_onnx"\nmax_batch_size: 4\n'
        "instance_group [ { count: 3 kind: KIND_CPU } ]\n"
    )
    model = read_model(model_dir, "cpu")
    _usable(model)
    assert model.config is not None
    assert [spec.name for spec in model.config.inputs] == ["x"]
    assert model.config.instance_groups[0].count == 3


@pytest.mark.parametrize("name", ["../m", "h 100", "a/b", "x" * 129])
def test_a_custom_configuration_name_names_a_file_in_configs(tmp_path: Path, name: str) -> None:
    model_dir = _model(tmp_path, "m", IDENTITY_CONFIG)
    with pytest.raises(InvalidConfig, match="invalid custom model configuration name"):
        config_source(model_dir, name)
