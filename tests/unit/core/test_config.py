from __future__ import annotations

import json
from pathlib import Path

import onnx
import pytest
from onnx import TensorProto, helper

from sluice.core.config import (
    DynamicBatching,
    InstanceGroup,
    ModelConfig,
    TensorSpec,
    VersionPolicy,
    autocomplete_from_onnx,
    config_from_json,
    config_from_proto,
    config_to_json,
    config_to_proto,
    model_config_pb2,
    parse_config_text,
)
from sluice.core.errors import InvalidConfig

FULL_CONFIG = """
name: "dense"
platform: "onnxruntime_onnx"
backend: "onnxruntime"
max_batch_size: 8
version_policy { specific { versions: [3, 1] } }
input [
  { name: "x" data_type: TYPE_FP32 dims: [-1, 4] },
  { name: "img" data_type: TYPE_UINT8 dims: [12] reshape { shape: [3, 4] } optional: true }
]
output [
  { name: "y" data_type: TYPE_STRING dims: [-1] },
  { name: "z" data_type: TYPE_BF16 dims: [1] reshape { shape: [] } }
]
instance_group [
  { name: "gpu_group" count: 2 kind: KIND_GPU gpus: [0, 1] },
  { count: 0 kind: KIND_CPU }
]
dynamic_batching {
  preferred_batch_size: [2, 4]
  max_queue_delay_microseconds: 100
  preserve_ordering: true
  priority_levels: 3
  default_priority_level: 2
  default_queue_policy {
    max_queue_size: 16
    default_timeout_microseconds: 5000
    allow_timeout_override: true
    timeout_action: DELAY
  }
}
parameters { key: "threads" value { string_value: "4" } }
parameters { key: "mode" value { string_value: "fast" } }
optimization {
  execution_accelerators {
    gpu_execution_accelerator [ { name: "tensorrt" }, { name: "cuda" } ]
  }
}
"""


def _onnx_model(
    path: Path,
    inputs: list[tuple[str, int, list[int | str | None]]],
    outputs: list[tuple[str, int, list[int | str | None]]],
) -> Path:
    """A model whose outputs are Identity copies of its first input."""
    nodes = [helper.make_node("Identity", [inputs[0][0]], [name]) for name, _, _ in outputs]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info(n, t, s) for n, t, s in inputs],
        [helper.make_tensor_value_info(n, t, s) for n, t, s in outputs],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    onnx.save(model, str(path))
    return path


# -- parsing ------------------------------------------------------------------------------


def test_full_config_fields() -> None:
    cfg = parse_config_text(FULL_CONFIG, model_name="dense")
    assert cfg.name == "dense"
    assert cfg.platform == "onnxruntime_onnx"
    assert cfg.backend == "onnxruntime"
    assert cfg.platform_or_backend == "onnxruntime_onnx"
    assert cfg.max_batch_size == 8
    assert cfg.inputs == (
        TensorSpec("x", "FP32", (-1, 4)),
        TensorSpec("img", "UINT8", (12,), reshape=(3, 4), optional=True),
    )
    assert cfg.outputs == (
        TensorSpec("y", "BYTES", (-1,)),
        TensorSpec("z", "BF16", (1,), reshape=()),
    )
    assert cfg.input("x") == cfg.inputs[0]
    assert cfg.input("nope") is None
    assert cfg.output("z") == cfg.outputs[1]
    assert cfg.output("x") is None
    assert cfg.version_policy == VersionPolicy(kind="specific", versions=(1, 3))
    assert cfg.instance_groups == (
        InstanceGroup("gpu_group", 2, "KIND_GPU", (0, 1)),
        InstanceGroup("dense_1", 1, "KIND_CPU", ()),
    )
    assert cfg.total_instances == 3
    assert cfg.dynamic_batching == DynamicBatching(
        preferred_batch_sizes=(2, 4),
        max_queue_delay_us=100,
        preserve_ordering=True,
        priority_levels=3,
        default_priority_level=2,
        max_queue_size=16,
        default_timeout_us=5000,
        allow_timeout_override=True,
        timeout_action="DELAY",
    )
    assert dict(cfg.parameters) == {"threads": "4", "mode": "fast"}
    assert cfg.default_model_filename == "model.onnx"
    assert cfg.execution_accelerators == ("tensorrt", "cuda")
    hash(cfg)  # frozen and hashable, parameters included


def test_minimal_config_defaults() -> None:
    cfg = parse_config_text(
        'backend: "python"\ninput { name: "a" data_type: TYPE_INT64 dims: [1] }',
        model_name="py",
    )
    assert cfg.name == "py"
    assert cfg.platform == ""
    assert cfg.backend == "python"
    assert cfg.platform_or_backend == "python"
    assert cfg.max_batch_size == 0
    assert cfg.outputs == ()
    assert cfg.version_policy == VersionPolicy()
    assert cfg.instance_groups == ()
    assert cfg.total_instances == 1
    assert cfg.dynamic_batching is None
    assert dict(cfg.parameters) == {}
    assert cfg.default_model_filename == "model.py"
    assert cfg.execution_accelerators == ()


@pytest.mark.parametrize(
    ("platform_line", "filename"),
    [
        ('platform: "onnxruntime_onnx"', "model.onnx"),
        ('backend: "onnxruntime"', "model.onnx"),
        ('platform: "pytorch_libtorch"', "model.pt"),
        ('platform: "tensorrt_plan"', "model.plan"),
        ('backend: "python"', "model.py"),
        ('platform: "torch_aoti"', "model.pt2"),
        ('backend: "custom"', ""),
        ('platform: "onnxruntime_onnx" default_model_filename: "net.onnx"', "net.onnx"),
    ],
)
def test_default_model_filename(platform_line: str, filename: str) -> None:
    cfg = parse_config_text(platform_line, model_name="m")
    assert cfg.default_model_filename == filename
    assert cfg.raw["default_model_filename"] == filename


def test_dynamic_batching_defaults() -> None:
    cfg = parse_config_text("max_batch_size: 4\ndynamic_batching {}", model_name="m")
    assert cfg.dynamic_batching == DynamicBatching()


# -- JSON rendering -------------------------------------------------------------------------


def test_raw_is_triton_json() -> None:
    raw = parse_config_text(FULL_CONFIG, model_name="dense").raw
    assert raw["name"] == "dense"
    assert raw["max_batch_size"] == 8
    assert raw["input"][0]["dims"] == [-1, 4]
    assert raw["input"][0]["data_type"] == "TYPE_FP32"
    assert raw["input"][1]["reshape"] == {"shape": [3, 4]}
    assert raw["output"][0]["data_type"] == "TYPE_STRING"
    assert raw["output"][1]["reshape"] == {"shape": []}
    assert raw["version_policy"] == {"specific": {"versions": [3, 1]}}
    batching = raw["dynamic_batching"]
    assert batching["max_queue_delay_microseconds"] == 100
    assert batching["priority_levels"] == 3
    assert batching["default_priority_level"] == 2
    assert batching["preferred_batch_size"] == [2, 4]
    assert batching["default_queue_policy"] == {
        "max_queue_size": 16,
        "default_timeout_microseconds": 5000,
        "allow_timeout_override": True,
        "timeout_action": "DELAY",
    }
    assert raw["instance_group"][0]["kind"] == "KIND_GPU"
    assert raw["instance_group"][1] == {
        **raw["instance_group"][1],
        "name": "dense_1",
        "count": 1,
        "kind": "KIND_CPU",
    }
    assert raw["parameters"]["threads"] == {"string_value": "4"}
    accelerators = raw["optimization"]["execution_accelerators"]["gpu_execution_accelerator"]
    assert [a["name"] for a in accelerators] == ["tensorrt", "cuda"]
    # Fields without presence are rendered with their defaults.
    assert raw["input"][0]["optional"] is False
    assert raw["input"][0]["is_shape_tensor"] is False
    assert raw["output"][0]["label_filename"] == ""
    assert raw["runtime"] == ""
    assert raw["model_warmup"] == []
    assert raw["metric_tags"] == {}
    json.dumps(raw)  # plain JSON types only


def test_raw_defaults_for_minimal_config() -> None:
    raw = parse_config_text('platform: "onnxruntime_onnx"', model_name="m").raw
    assert raw["name"] == "m"
    assert raw["max_batch_size"] == 0
    assert raw["version_policy"] == {"latest": {"num_versions": 1}}
    assert raw["input"] == [] and raw["output"] == []
    assert raw["instance_group"] == []
    assert "dynamic_batching" not in raw
    assert raw["default_model_filename"] == "model.onnx"


def test_int64_fields_in_maps_become_ints() -> None:
    cfg = parse_config_text(
        """
        max_batch_size: 2
        dynamic_batching {
          priority_levels: 2 default_priority_level: 1
          priority_queue_policy { key: 2 value { default_timeout_microseconds: 77 } }
        }
        """,
        model_name="m",
    )
    policy = cfg.raw["dynamic_batching"]["priority_queue_policy"]
    assert policy == {
        "2": {
            "default_timeout_microseconds": 77,
            "timeout_action": "REJECT",
            "allow_timeout_override": False,
            "max_queue_size": 0,
        }
    }


def test_json_round_trip() -> None:
    cfg = parse_config_text(FULL_CONFIG, model_name="dense")
    data = config_to_json(cfg)
    assert data == cfg.raw
    data["name"] = "mutated"
    assert cfg.raw["name"] == "dense"  # a private copy
    data["name"] = "dense"
    again = config_from_json(json.loads(json.dumps(data)), model_name="dense")
    assert again == cfg
    assert again.raw == cfg.raw
    assert config_to_json(again) == data


def test_config_to_proto_and_back() -> None:
    cfg = parse_config_text(FULL_CONFIG, model_name="dense")
    msg = config_to_proto(cfg)
    assert isinstance(msg, model_config_pb2().ModelConfig)
    assert config_from_proto(msg, model_name="dense") == cfg


def test_config_from_json_rejects_bad_data() -> None:
    with pytest.raises(InvalidConfig, match="config JSON"):
        config_from_json({"max_batch_size": "many"}, model_name="m")
    with pytest.raises(InvalidConfig, match="name 'a' does not match"):
        config_from_json({"name": "a"}, model_name="b")


# -- invalid configs ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('name: "foo"', "config.pbtxt: name 'foo' does not match the model directory 'bar'"),
        ("max_batch_size: 4\nfoo: 1", 'line 2, column 1: .*no field named "foo"'),
        ("input { name: 'x' data_type: TYPE_FOO dims: [1] }", "TYPE_FOO"),
        ("max_batch_size: -1", "max_batch_size must be >= 0"),
        ("input { name: 'x' data_type: TYPE_FP32 }", "input 'x': dims must not be empty"),
        (
            "input { name: 'x' data_type: TYPE_FP32 dims: [1] }\n"
            "input { name: 'x' data_type: TYPE_FP32 dims: [1] }",
            "input 'x': duplicate input name",
        ),
        (
            "output { name: 'y' data_type: TYPE_FP32 dims: [1] }\n"
            "output { name: 'y' data_type: TYPE_INT8 dims: [2] }",
            "output 'y': duplicate output name",
        ),
        ("input { name: 'x' dims: [1] }", "input 'x': data_type must be set"),
        (
            "output { name: 'y' data_type: TYPE_INVALID dims: [1] }",
            "output 'y': data_type must be set",
        ),
        ("input { data_type: TYPE_FP32 dims: [1] }", "input #0: name must not be empty"),
        ("input { name: 'x' data_type: TYPE_FP32 dims: [-2] }", "input 'x': dims \\[-2\\]"),
        ("output { name: 'y' data_type: TYPE_FP32 dims: [0] }", "output 'y': dims \\[0\\]"),
        (
            "input { name: 'x' data_type: TYPE_FP32 dims: [6] reshape { shape: [4] } }",
            "input 'x': dims \\[6\\] and reshape \\[4\\] have different element counts",
        ),
        (
            "input { name: 'x' data_type: TYPE_FP32 dims: [6] reshape { shape: [0] } }",
            "input 'x': reshape \\[0\\]",
        ),
        (
            "input { name: 'x' data_type: TYPE_FP32 dims: [2, -1] reshape { shape: [2] } }",
            "variable-size dimensions",
        ),
        (
            "max_batch_size: 4\ndynamic_batching { preferred_batch_size: [2, 8] }",
            "dynamic_batching: preferred_batch_size 8 must be between 1 and max_batch_size 4",
        ),
        ("dynamic_batching { }", "dynamic_batching: requires max_batch_size > 0"),
        (
            "max_batch_size: 4\ndynamic_batching { priority_levels: 2 }",
            "dynamic_batching: default_priority_level 0 must be in \\[1, 2\\]",
        ),
        (
            "max_batch_size: 4\ndynamic_batching { priority_levels: 2 default_priority_level: 3 }",
            "default_priority_level 3",
        ),
        ("instance_group { count: -1 }", "instance_group #0: count must be >= 0"),
        (
            "instance_group { name: 'g' kind: KIND_CPU gpus: [0] }",
            "instance_group 'g': kind KIND_CPU cannot list gpus",
        ),
        (
            "version_policy { specific { } }",
            "version_policy: specific.versions must not be empty",
        ),
        (
            "version_policy { latest { num_versions: 0 } }",
            "version_policy: latest.num_versions must be >= 1",
        ),
    ],
)
def test_invalid_config(text: str, message: str) -> None:
    with pytest.raises(InvalidConfig, match=message) as info:
        parse_config_text(text, model_name="bar")
    assert info.value.message.startswith("config.pbtxt: ")


_OUT = "output { name: 'y' data_type: TYPE_FP32 dims: [1] label_filename: '%s' }"
_STEP = (
    "platform: 'ensemble'\ninput { name: 'x' data_type: TYPE_FP32 dims: [1] }\n"
    "output { name: 'y' data_type: TYPE_FP32 dims: [1] }\n"
    "ensemble_scheduling { step { model_name: '%s' model_version: -1 "
    "input_map { key: 'x' value: 'x' } output_map { key: 'y' value: 'y' } } }"
)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (_OUT % "/etc/passwd", "output 'y': label_filename '/etc/passwd' must be a relative"),
        (_OUT % "../../etc/passwd", "label_filename '../../etc/passwd' must be a relative"),
        (_OUT % "1/../../x", "label_filename '1/../../x' must be a relative"),
        (_OUT % "labels\\0.txt", "output 'y': label_filename .* must not contain a NUL"),
        ("default_model_filename: '/etc/passwd'", "default_model_filename '/etc/passwd' must"),
        ("default_model_filename: '../m.onnx'", "default_model_filename '../m.onnx' must"),
        ("default_model_filename: '..'", "default_model_filename '..' must be a plain name"),
        ("default_model_filename: 'a\\0'", "default_model_filename .* must not contain a NUL"),
        (_STEP % "../../etc", "step\\[0\\]: model_name '../../etc' is not the name of a model"),
        (_STEP % "/etc", "model_name '/etc' is not the name of a model"),
        (_STEP % "..", "model_name '..' is not the name of a model"),
        (_STEP % ".hidden", "model_name '.hidden' is not the name of a model"),
    ],
)
def test_a_config_names_no_file_or_model_outside_its_own(text: str, message: str) -> None:
    """A configuration may be a client's (a load's): the files it names stay inside the
    model's folder, the models it calls are models of the repository."""
    with pytest.raises(InvalidConfig, match=message):
        parse_config_text(text, model_name="bar")


def test_labels_and_model_files_inside_the_model_are_fine() -> None:
    cfg = parse_config_text(
        (_OUT % "labels/y.txt") + "\ndefault_model_filename: 'net.onnx'", model_name="bar"
    )
    assert cfg.outputs[0].label_filename == "labels/y.txt"
    assert cfg.default_model_filename == "net.onnx"


def test_reshape_with_matching_variable_chunks_is_valid() -> None:
    cfg = parse_config_text(
        "input { name: 'x' data_type: TYPE_FP32 dims: [2, 4, -1, 6] "
        "reshape { shape: [8, -1, 1, 6] } }",
        model_name="m",
    )
    assert cfg.inputs[0].reshape == (8, -1, 1, 6)


# -- version policy ---------------------------------------------------------------------------


def test_version_policy_select() -> None:
    available = [3, 1, 10, 2]
    assert VersionPolicy().select(available) == (10,)
    assert VersionPolicy(num_versions=2).select(available) == (3, 10)
    assert VersionPolicy(num_versions=9).select(available) == (1, 2, 3, 10)
    assert VersionPolicy(kind="all").select(available) == (1, 2, 3, 10)
    assert VersionPolicy(kind="specific", versions=(2, 10, 7)).select(available) == (2, 10)
    assert VersionPolicy().select([]) == ()


# -- autocomplete -----------------------------------------------------------------------------


def test_autocomplete_without_config_batching(tmp_path: Path) -> None:
    path = _onnx_model(
        tmp_path / "model.onnx",
        [("x", TensorProto.FLOAT, ["batch", 4]), ("w", TensorProto.INT64, [None, 2, 3])],
        [("y", TensorProto.FLOAT, ["batch", 4]), ("s", TensorProto.STRING, [-1])],
    )
    cfg = autocomplete_from_onnx(None, path, model_name="auto")
    assert isinstance(cfg, ModelConfig)
    assert cfg.name == "auto"
    assert cfg.platform == "onnxruntime_onnx"
    assert cfg.backend == "onnxruntime"
    assert cfg.max_batch_size == 4
    assert cfg.dynamic_batching == DynamicBatching()
    assert cfg.inputs == (TensorSpec("x", "FP32", (4,)), TensorSpec("w", "INT64", (2, 3)))
    # A tensor that is only the batch dimension becomes one element per item.
    assert cfg.outputs == (TensorSpec("y", "FP32", (4,)), TensorSpec("s", "BYTES", (1,), ()))
    assert cfg.default_model_filename == "model.onnx"
    assert cfg.raw["max_batch_size"] == 4
    assert cfg.raw["input"][0]["dims"] == [4]
    assert cfg.raw["output"][1]["data_type"] == "TYPE_STRING"
    assert "dynamic_batching" in cfg.raw
    assert config_from_json(cfg.raw, model_name="auto") == cfg


def test_autocomplete_without_config_fixed_batch(tmp_path: Path) -> None:
    path = _onnx_model(
        tmp_path / "model.onnx",
        [("x", TensorProto.FLOAT16, [1, 3])],
        [("y", TensorProto.FLOAT16, ["n", 3])],
    )
    cfg = autocomplete_from_onnx(None, path, model_name="fixed", default_max_batch_size=16)
    assert cfg.max_batch_size == 0
    assert cfg.dynamic_batching is None
    assert cfg.inputs == (TensorSpec("x", "FP16", (1, 3)),)
    assert cfg.outputs == (TensorSpec("y", "FP16", (-1, 3)),)
    assert cfg.raw["input"][0]["dims"] == [1, 3]


def test_autocomplete_skips_initializers(tmp_path: Path) -> None:
    weight = helper.make_tensor("w", TensorProto.FLOAT, [2], [1.0, 2.0])
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "w"], ["y"])],
        "g",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 2]),
            helper.make_tensor_value_info("w", TensorProto.FLOAT, [2]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", 2])],
        initializer=[weight],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    onnx.save(model, str(tmp_path / "model.onnx"))
    cfg = autocomplete_from_onnx(None, tmp_path / "model.onnx", model_name="m")
    assert [t.name for t in cfg.inputs] == ["x"]
    assert cfg.max_batch_size == 4


def test_autocomplete_fills_missing_outputs(tmp_path: Path) -> None:
    path = _onnx_model(
        tmp_path / "model.onnx",
        [("x", TensorProto.FLOAT, ["b", 4])],
        [("y", TensorProto.DOUBLE, ["b", 2, 2]), ("flag", TensorProto.BOOL, ["b", 1])],
    )
    base = parse_config_text(
        """
        platform: "onnxruntime_onnx"
        max_batch_size: 8
        input { name: "x" data_type: TYPE_FP32 dims: [4] }
        instance_group { count: 2 kind: KIND_CPU }
        """,
        model_name="m",
    )
    cfg = autocomplete_from_onnx(base, path, model_name="m")
    assert cfg.max_batch_size == 8
    assert cfg.dynamic_batching is None
    assert cfg.inputs == base.inputs
    assert cfg.outputs == (TensorSpec("y", "FP64", (2, 2)), TensorSpec("flag", "BOOL", (1,)))
    assert cfg.instance_groups == base.instance_groups
    assert cfg.backend == ""
    assert [o["name"] for o in cfg.raw["output"]] == ["y", "flag"]
    assert cfg.raw["output"][0]["dims"] == [2, 2]


def test_autocomplete_respects_non_batching_config(tmp_path: Path) -> None:
    path = _onnx_model(
        tmp_path / "model.onnx",
        [("x", TensorProto.INT32, ["b", 4])],
        [("y", TensorProto.INT32, ["b", 4])],
    )
    base = parse_config_text('backend: "onnxruntime"', model_name="m")
    cfg = autocomplete_from_onnx(base, path, model_name="m")
    assert cfg.max_batch_size == 0
    assert cfg.inputs == (TensorSpec("x", "INT32", (-1, 4)),)
    assert cfg.outputs == (TensorSpec("y", "INT32", (-1, 4)),)


def test_autocomplete_rejects_fixed_first_dim_with_batching(tmp_path: Path) -> None:
    path = _onnx_model(
        tmp_path / "model.onnx",
        [("x", TensorProto.FLOAT, [1, 4])],
        [("y", TensorProto.FLOAT, [1, 4])],
    )
    base = parse_config_text('platform: "onnxruntime_onnx"\nmax_batch_size: 8', model_name="m")
    with pytest.raises(InvalidConfig, match="input 'x' has shape \\[1, 4\\] but max_batch_size"):
        autocomplete_from_onnx(base, path, model_name="m")


def test_autocomplete_rejects_corrupt_model(tmp_path: Path) -> None:
    path = tmp_path / "model.onnx"
    path.write_bytes(b"definitely not protobuf \xff\xfe")
    with pytest.raises(InvalidConfig, match=r"model\.onnx: cannot read the ONNX model"):
        autocomplete_from_onnx(None, path, model_name="m")
    path.write_bytes(b"")
    with pytest.raises(InvalidConfig, match="no outputs"):
        autocomplete_from_onnx(None, path, model_name="m")
    with pytest.raises(InvalidConfig, match="cannot read"):
        autocomplete_from_onnx(None, tmp_path / "missing.onnx", model_name="m")


def test_autocomplete_rejects_unsupported_type(tmp_path: Path) -> None:
    path = _onnx_model(
        tmp_path / "model.onnx",
        [("x", TensorProto.COMPLEX64, ["b", 2])],
        [("y", TensorProto.COMPLEX64, ["b", 2])],
    )
    with pytest.raises(InvalidConfig, match="'x' has unsupported ONNX element type"):
        autocomplete_from_onnx(None, path, model_name="m")
