"""parse_infer_request against bodies built by tritonclient itself, plus every rejection."""

from __future__ import annotations

import struct
import tracemalloc
from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np
import orjson
import pytest
import tritonclient.http as httpclient

from sluice.core.datatypes import serialize_bytes, to_numpy
from sluice.core.errors import InvalidInput
from sluice.gateway.inference.parsing import parse_infer_document, parse_infer_request
from sluice.gateway.inference.request import InferRequest, RequestedOutput, RequestLimits
from tests.support.samples import FIXED_TYPES, sample

# --------------------------------------------------------------------- fakes


@dataclass(frozen=True)
class Spec:
    name: str
    datatype: str
    dims: tuple[int, ...]
    reshape: tuple[int, ...] | None = None
    optional: bool = False


@dataclass(frozen=True)
class Config:
    name: str
    max_batch_size: int
    inputs: tuple[Spec, ...]
    outputs: tuple[Spec, ...]

    def input(self, name: str) -> Spec | None:
        return next((s for s in self.inputs if s.name == name), None)

    def output(self, name: str) -> Spec | None:
        return next((s for s in self.outputs if s.name == name), None)


def one_input(
    datatype: str, dims: tuple[int, ...], max_batch_size: int = 4, name: str = "INPUT0"
) -> Config:
    return Config(
        name="m",
        max_batch_size=max_batch_size,
        inputs=(Spec(name, datatype, dims),),
        outputs=(Spec("OUT0", datatype, dims), Spec("OUT1", "FP32", (1,))),
    )


TWO = Config(
    name="two",
    max_batch_size=8,
    inputs=(
        Spec("a", "FP32", (4,)),
        Spec("b", "INT32", (-1,)),
        Spec("c", "BYTES", (1,), optional=True),
    ),
    outputs=(Spec("x", "FP32", (4,)), Spec("y", "INT64", (1,)), Spec("z", "BYTES", (1,))),
)

FIXED = Config(
    name="fixed",
    max_batch_size=0,
    inputs=(Spec("x", "FP32", (-1, 4)),),
    outputs=(Spec("y", "FP32", (-1, 4)),),
)

# ------------------------------------------------------------------- helpers


def triton_input(name: str, array: np.ndarray, datatype: str, binary: bool = True):
    tensor = httpclient.InferInput(name, list(array.shape), datatype)
    tensor.set_data_from_numpy(array, binary_data=binary)
    return tensor


def client_body(inputs: list[Any], **kwargs: Any) -> tuple[bytes, int | None]:
    return httpclient.InferenceServerClient.generate_request_body(inputs, **kwargs)


def parse(body: bytes, header_length: int | None, config: Any = TWO, **limits: Any) -> InferRequest:
    return parse_infer_request(body, header_length, config, RequestLimits(**limits))


def decoded(request: InferRequest, index: int = 0) -> np.ndarray:
    tensor = request.inputs[index]
    return to_numpy(tensor.datatype, tensor.shape, tensor.data)


def json_request(inputs: list[dict[str, Any]], **extra: Any) -> bytes:
    return orjson.dumps({"inputs": inputs, **extra})


def good_a(**overrides: Any) -> dict[str, Any]:
    item = {"name": "a", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}
    item.update(overrides)
    return item


def good_b(**overrides: Any) -> dict[str, Any]:
    item = {"name": "b", "shape": [1, 2], "datatype": "INT32", "data": [5, 6]}
    item.update(overrides)
    return item


def rejects(
    body: bytes, header_length: int | None, *fragments: str, config: Any = TWO, **limits: Any
) -> str:
    with pytest.raises(InvalidInput) as info:
        parse(body, header_length, config, **limits)
    message = info.value.message
    for fragment in fragments:
        assert fragment in message, message
    return message


# ------------------------------------------------------------ happy paths


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
@pytest.mark.parametrize(("datatype", "dtype"), FIXED_TYPES, ids=[t for t, _ in FIXED_TYPES])
def test_every_fixed_width_datatype_round_trips(datatype: str, dtype: Any, binary: bool) -> None:
    array = sample(dtype, (2, 3))
    body, size = client_body([triton_input("INPUT0", array, datatype, binary)])
    assert (size is None) == (not binary)
    request = parse(body, size, one_input(datatype, (3,)))
    tensor = request.inputs[0]
    assert (tensor.name, tensor.datatype, tensor.shape) == ("INPUT0", datatype, (2, 3))
    assert request.batch_size == 2
    np.testing.assert_array_equal(decoded(request), array)
    assert decoded(request).dtype == array.dtype


def test_binary_inputs_are_zero_copy_slices_of_the_body() -> None:
    a = np.arange(8, dtype=np.float32).reshape(2, 4)
    b = np.array([[1, 2, 3], [4, 5, 6]], dtype=np.int32)
    body, size = client_body([triton_input("a", a, "FP32"), triton_input("b", b, "INT32")])
    request = parse(body, size)
    for tensor in request.inputs:
        assert isinstance(tensor.data, memoryview)
        assert tensor.data.obj is body
    np.testing.assert_array_equal(decoded(request, 0), a)
    np.testing.assert_array_equal(decoded(request, 1), b)
    assert request.batch_size == 2


def test_bf16_binary_from_tritonclient() -> None:
    values = np.array([[1.5, -2.25, 3.0e10, 0.0]], dtype=np.float32)
    array = values.astype(ml_dtypes.bfloat16)
    body, size = client_body([triton_input("INPUT0", array, "BF16")])
    request = parse(body, size, one_input("BF16", (4,)))
    assert request.inputs[0].data.tobytes() == array.tobytes()
    np.testing.assert_array_equal(decoded(request), array.astype(np.float32))


def test_bf16_json_numbers_are_converted() -> None:
    body = json_request(
        [{"name": "INPUT0", "shape": [1, 3], "datatype": "BF16", "data": [1.5, -2, 0.25]}]
    )
    request = parse(body, None, one_input("BF16", (3,)))
    assert request.inputs[0].data == np.array([[1.5, -2, 0.25]], ml_dtypes.bfloat16).tobytes()


def test_bytes_binary_including_non_utf8() -> None:
    array = np.array([[b"\xff\xfe\x00", b"abc", b""]], dtype=np.object_)
    body, size = client_body([triton_input("INPUT0", array, "BYTES")])
    request = parse(body, size, one_input("BYTES", (3,)))
    assert decoded(request).tolist() == array.tolist()
    assert isinstance(request.inputs[0].data, memoryview)


def test_bytes_json_strings_are_utf8_encoded() -> None:
    array = np.array([["héllo", "wörld"]], dtype=np.object_)
    body, size = client_body([triton_input("INPUT0", array, "BYTES", binary=False)])
    assert size is None
    request = parse(body, size, one_input("BYTES", (2,)))
    assert request.inputs[0].data == serialize_bytes(["héllo", "wörld"])


def test_unbatched_model_batch_size_is_one_and_variable_dims_match() -> None:
    array = np.ones((3, 4), dtype=np.float32)
    body, size = client_body([triton_input("x", array, "FP32")])
    request = parse(body, size, FIXED)
    assert request.batch_size == 1
    assert request.inputs[0].shape == (3, 4)


def test_mixed_json_and_binary_inputs() -> None:
    a = np.arange(4, dtype=np.float32).reshape(1, 4)
    b = np.array([[7, 8, 9]], dtype=np.int32)
    c = np.array([[b"\x00\xff"]], dtype=np.object_)
    body, size = client_body(
        [
            triton_input("a", a, "FP32", False),
            triton_input("b", b, "INT32"),
            triton_input("c", c, "BYTES"),
        ]
    )
    request = parse(body, size)
    np.testing.assert_array_equal(decoded(request, 0), a)
    np.testing.assert_array_equal(decoded(request, 1), b)
    assert decoded(request, 2).tolist() == [[b"\x00\xff"]]


def test_nested_json_data_is_flattened() -> None:
    body = json_request(
        [{"name": "x", "shape": [2, 4], "datatype": "FP32", "data": [[1, 2, 3, 4], [5, 6, 7, 8]]}]
    )
    request = parse(body, None, FIXED)
    np.testing.assert_array_equal(decoded(request), np.arange(1, 9, dtype=np.float32).reshape(2, 4))


def test_ragged_nested_json_data_is_flattened_in_order() -> None:
    body = json_request(
        [
            {
                "name": "x",
                "shape": [2, 4],
                "datatype": "FP32",
                "data": [[1, [2, 3]], [4, 5, 6, 7], 8],
            },
        ]
    )
    request = parse(body, None, FIXED)
    np.testing.assert_array_equal(decoded(request).ravel(), np.arange(1, 9, dtype=np.float32))


def test_nested_bytes_json_and_bool_from_ints() -> None:
    config = Config(
        "m",
        0,
        (Spec("s", "BYTES", (2, 2)), Spec("f", "BOOL", (3,))),
        (Spec("o", "BYTES", (2, 2)),),
    )
    body = json_request(
        [
            {"name": "s", "shape": [2, 2], "datatype": "BYTES", "data": [["a", "b"], ["c", "d"]]},
            {"name": "f", "shape": [3], "datatype": "BOOL", "data": [1, 0, True]},
        ]
    )
    request = parse(body, None, config)
    assert decoded(request, 0).tolist() == [[b"a", b"b"], [b"c", b"d"]]
    assert decoded(request, 1).tolist() == [True, False, True]


def test_empty_tensor_in_json_and_binary() -> None:
    json_body = json_request([{"name": "x", "shape": [0, 4], "datatype": "FP32", "data": []}])
    assert parse(json_body, None, FIXED).inputs[0].data == b""
    body, size = client_body([triton_input("x", np.empty((0, 4), np.float32), "FP32")])
    request = parse(body, size, FIXED)
    assert request.inputs[0].shape == (0, 4)
    assert len(request.inputs[0].data) == 0


def test_optional_input_may_be_omitted() -> None:
    request = parse(json_request([good_a(), good_b()]), None)
    assert [t.name for t in request.inputs] == ["a", "b"]


def test_all_outputs_binary_when_client_requests_none() -> None:
    a = np.zeros((1, 4), np.float32)
    b = np.zeros((1, 1), np.int32)
    body, size = client_body(
        [triton_input("a", a, "FP32"), triton_input("b", b, "INT32")],
        request_id="req-7",
        priority=3,
        timeout=1000,
        parameters={"custom": "yes"},
    )
    request = parse(body, size)
    assert request.id == "req-7"
    assert request.outputs == [
        RequestedOutput("x", True),
        RequestedOutput("y", True),
        RequestedOutput("z", True),
    ]
    assert request.parameters == {"priority": 3, "timeout": 1000, "custom": "yes"}


def test_requested_output_subset_keeps_request_order_and_flags() -> None:
    a = np.zeros((1, 4), np.float32)
    b = np.zeros((1, 1), np.int32)
    outputs = [
        httpclient.InferRequestedOutput("z", binary_data=False),
        httpclient.InferRequestedOutput("x"),
    ]
    body, size = client_body(
        [triton_input("a", a, "FP32"), triton_input("b", b, "INT32")], outputs=outputs
    )
    request = parse(body, size)
    assert request.outputs == [
        RequestedOutput("z", False, json_asked=True),
        RequestedOutput("x", True),
    ]
    assert request.id == ""
    assert request.parameters == {}


def test_binary_data_output_is_default_unless_overridden() -> None:
    body = json_request(
        [good_a(), good_b()],
        outputs=[{"name": "y"}, {"name": "x", "parameters": {"binary_data": False}}],
        parameters={"binary_data_output": True, "sequence_id": 5},
    )
    request = parse(body, None)
    assert request.outputs == [
        RequestedOutput("y", True),
        RequestedOutput("x", False, json_asked=True),
    ]
    assert request.parameters == {"sequence_id": 5}


def test_default_outputs_are_json_and_classification_zero_is_allowed() -> None:
    request = parse(json_request([good_a(), good_b()]), None)
    assert all(not output.binary for output in request.outputs)
    body = json_request(
        [good_a(), good_b()], outputs=[{"name": "x", "parameters": {"classification": 0}}]
    )
    assert parse(body, None).outputs == [RequestedOutput("x", False)]


def test_unknown_top_level_fields_are_ignored() -> None:
    assert parse(json_request([good_a(), good_b()], model_name="two"), None).batch_size == 1


# ---------------------------------------------------------------- raw binary


def test_raw_binary_fixed_shape() -> None:
    data = np.arange(8, dtype=np.float32).tobytes()
    request = parse(data, 0, one_input("FP32", (8,)))
    tensor = request.inputs[0]
    assert tensor.shape == (1, 8)
    assert tensor.data.obj is data
    assert request.batch_size == 1
    assert all(output.binary for output in request.outputs)
    assert [output.name for output in request.outputs] == ["OUT0", "OUT1"]


def test_raw_binary_deduces_one_variable_dim() -> None:
    data = np.arange(12, dtype=np.float32).tobytes()
    request = parse(data, 0, FIXED)
    assert request.inputs[0].shape == (3, 4)


def test_raw_binary_bytes_gets_a_length_prefix() -> None:
    request = parse(b"\xffraw", 0, one_input("BYTES", (1,)))
    assert request.inputs[0].shape == (1, 1)
    assert decoded(request).tolist() == [[b"\xffraw"]]
    request = parse(b"abc", 0, one_input("BYTES", (1,), max_batch_size=0))
    assert request.inputs[0].shape == (1,)
    # Triton's rule: dims of one element and no -1, whatever their rank.
    assert parse(b"abc", 0, one_input("BYTES", (1, 1))).inputs[0].shape == (1, 1, 1)


@pytest.mark.parametrize(
    ("body", "config", "fragments"),
    [
        (
            b"\x00" * 8,
            TWO,
            (
                "[request id: <id_unknown>] Raw request must only have 1 input (found 1) to be "
                "deduced but got 3 inputs in 'two' model configuration",
            ),
        ),
        (
            b"\x00" * 8,
            one_input("FP32", (-1, -1)),
            (
                "[request id: <id_unknown>] The shape of the raw input 'INPUT0' can not be "
                "deduced because there are more than one variable-sized dimension",
            ),
        ),
        (
            b"\x00" * 12,
            one_input("FP32", (4,)),
            (
                "[request id: <id_unknown>] input byte size mismatch for input 'INPUT0' for "
                "model 'm'. Expected 16, got 12",
            ),
        ),
        (
            b"\x00" * 10,
            one_input("FP32", (-1, 2)),
            ("input byte size mismatch for input 'INPUT0'", "Expected 8, got 10", "whole number"),
        ),
        (
            b"abc",
            one_input("BYTES", (2,)),
            (
                "[request id: <id_unknown>] For BYTE datatype raw input 'INPUT0', the model "
                "must have input shape [1]",
            ),
        ),
        (b"abc", one_input("BYTES", (-1,)), ("For BYTE datatype raw input 'INPUT0'",)),
        (b"\x00" * 40, one_input("INT8", (-1,)), ("input 'INPUT0'", "limit of 16")),
    ],
)
def test_raw_binary_rejections(body: bytes, config: Config, fragments: tuple[str, ...]) -> None:
    rejects(body, 0, *fragments, config=config, max_elements=16)


# ------------------------------------------------------------------ rejections


def test_header_length_out_of_range() -> None:
    body = json_request([good_a(), good_b()])
    rejects(body, len(body) + 1, "Inference-Header-Content-Length", str(len(body) + 1))
    rejects(body, -1, "Inference-Header-Content-Length -1")


@pytest.mark.parametrize(
    ("body", "fragments"),
    [
        (b"{not json", ("malformed request body",)),
        (b"", ("malformed request body",)),
        (b"[1, 2]", ("malformed request body", "JSON object")),
        (b'{"inputs": [], "id": 5}', ("'id'", "string")),
        (b'{"inputs": [], "parameters": [1]}', ("'parameters'", "object")),
        (
            b'{"inputs": [], "parameters": {"p": [1]}}',
            ("parameter 'p' has invalid type", "'int', 'bool', or 'string'"),
        ),
        (b'{"inputs": [], "parameters": {"p": null}}', ("parameter 'p' has invalid type",)),
        (
            b'{"inputs": [], "parameters": {"triton_x": 1}}',
            ("keys starting with 'triton_' are reserved for Triton usage",),
        ),
        (
            b'{"inputs": [], "parameters": {"binary_data_output": 1}}',
            ("Unable to parse 'binary_data_output'", "non-boolean as boolean"),
        ),
        (b"{}", ("'inputs'", "required")),
        (b'{"inputs": {}}', ("'inputs'", "list")),
        (b'{"inputs": []}', ("'inputs'", "empty")),
        (b'{"inputs": [3]}', ("inputs[0]", "object")),
        (b'{"inputs": [{"shape": [1]}]}', ("inputs[0]", "'name'", "required")),
        (b'{"inputs": [{"name": 7}]}', ("inputs[0]", "'name'", "string")),
    ],
)
def test_request_structure_rejections(body: bytes, fragments: tuple[str, ...]) -> None:
    rejects(body, None, *fragments)


def test_request_parameters_are_bounded_in_number_and_name_length() -> None:
    """Each parameter travels in the stream entry and becomes an object of the worker's: a
    body of millions of tiny ones is refused, not carried."""
    many = {f"p{i}": i for i in range(9)}
    body = json_request([good_a(), good_b()], parameters=many)
    rejects(body, None, "request 'parameters' has 9 entries", "limit of 8", max_parameters=8)
    assert parse(body, None, max_parameters=9).parameters == many
    long_name = json_request([good_a(), good_b()], parameters={"n" * 33: 1})
    rejects(long_name, None, "request parameter 'nnn", "longer than 32", max_string_length=32)


def test_a_grpc_parameter_that_json_cannot_carry_is_refused() -> None:
    """gRPC's double_param may be NaN or infinite; the JSON a Python model reads
    (``request.parameters()``) holds no such number."""
    config: Any = TWO
    doc = {"inputs": [good_a(), good_b()], "parameters": {"ratio": float("nan")}}
    with pytest.raises(InvalidInput, match="parameter 'ratio' must be a finite number"):
        parse_infer_document(doc, memoryview(b""), config, RequestLimits())
    doc["parameters"] = {"ratio": float("-inf")}
    with pytest.raises(InvalidInput, match="parameter 'ratio' must be a finite number"):
        parse_infer_document(doc, memoryview(b""), config, RequestLimits())


@pytest.mark.parametrize(
    ("overrides", "fragments"),
    [
        ({"shape": None}, ("input 'a'", "'shape'", "required")),
        ({"shape": "1,4"}, ("input 'a'", "'shape'", "list")),
        ({"shape": [1, -4]}, ("input 'a'", "dim 1", "non-negative integer", "-4")),
        ({"shape": [1, 4.0]}, ("input 'a'", "dim 1", "number")),
        ({"shape": [True, 4]}, ("input 'a'", "dim 0", "boolean")),
        ({"shape": [1, 1 << 63]}, ("input 'a'", "dim 1")),
        ({"datatype": None}, ("input 'a'", "'datatype'", "required")),
        ({"datatype": "FLOAT"}, ("input 'a'", "unknown datatype 'FLOAT'", "FP32")),
        ({"parameters": []}, ("input 'a'", "'parameters'", "object")),
        (
            {"parameters": {"binary_data_size": 16}},
            ("Input must set only one of", "But set 'data' 'binary_data_size'; input 'a'"),
        ),
        ({"data": None}, ("Input must set only one of", "But no field is set; input 'a'")),
        (
            {"parameters": {"shared_memory_region": "r", "shared_memory_byte_size": 16}},
            ("Input must set only one of", "But set 'data' 'shared_memory_region'; input 'a'"),
        ),
        (
            {"data": None, "parameters": {"binary_data_size": -1}},
            ("Unable to parse 'binary_data_size': attempt to access JSON non-unsigned", "'a'"),
        ),
        (
            {"data": None, "parameters": {"binary_data_size": True}},
            ("Unable to parse 'binary_data_size'", "; input 'a'"),
        ),
        (
            {"name": "nope"},
            ("unexpected inference input 'nope' for model 'two'", "'a', 'b', 'c'"),
        ),
        (
            {"datatype": "INT32"},
            (
                "[request id: <id_unknown>] inference input 'a' data-type is 'INT32', but "
                "model 'two' expects 'FP32'",
            ),
        ),
        (
            {"shape": [1, 5]},
            (
                "[request id: <id_unknown>] unexpected shape for input 'a' for model 'two'. "
                "Expected [-1,4], got [1,5]. NOTE: Setting a non-zero max_batch_size",
            ),
        ),
        (
            {"shape": [4]},
            ("unexpected shape for input 'a' for model 'two'. Expected [-1,4], got [4].",),
        ),
        (
            {"shape": [9, 4], "data": [0] * 36},
            ("[request id: <id_unknown>] inference request batch-size must be <= 8 for 'two'",),
        ),
        ({"shape": [0, 4]}, ("input 'a'", "batch size must be at least 1")),
        ({"shape": []}, ("input 'a' has no shape but model requires batch dimension for 'two'",)),
    ],
)
def test_input_rejections(overrides: dict[str, Any], fragments: tuple[str, ...]) -> None:
    item = good_a(**overrides)
    item = {key: value for key, value in item.items() if value is not None}
    shape = overrides.get("shape")
    b = good_b()
    if isinstance(shape, list) and shape and all(type(d) is int and d >= 0 for d in shape):
        b = good_b(shape=[shape[0], 1], data=[0] * shape[0])  # the same batch size
    rejects(json_request([item, b]), None, *fragments)


def test_duplicate_and_missing_inputs() -> None:
    rejects(
        json_request([good_a(), good_b(), good_a()], id="r1"),
        None,
        "[request id: r1] input 'a' already exists in request",
    )
    rejects(
        json_request([good_a()]),
        None,
        "[request id: <id_unknown>] expected number of inputs between 2 and 3 but got 1 inputs "
        "for model 'two'. Got input(s) ['a'], but missing required input(s) ['b']. Please "
        "provide all required input(s).",
    )
    # The count fits, but the optional input stands in for a required one.
    c = {"name": "c", "shape": [1, 1], "datatype": "BYTES", "data": ["s"]}
    rejects(json_request([good_a(), c]), None, "missing required input(s) ['b']")
    exact = Config("m", 0, (Spec("p", "FP32", (1,)), Spec("q", "FP32", (1,))), ())
    p = {"name": "p", "shape": [1], "datatype": "FP32", "data": [1]}
    rejects(
        json_request([p]),
        None,
        "expected 2 inputs but got 1 inputs for model 'm'. Got input(s) ['p'], but missing "
        "required input(s) ['q']. Please provide all required input(s).",
        config=exact,
    )
    # Too many: Triton counts first (and prints "]" where nothing is missing; Sluice "[]").
    rejects(
        json_request([p, {**p, "name": "q"}, {**p, "name": "extra"}]),
        None,
        "expected 2 inputs but got 3 inputs for model 'm'. Got input(s) ['p','q','extra'], "
        "but missing required input(s) []",
        config=exact,
    )


def test_too_many_inputs_and_long_strings() -> None:
    rejects(json_request([good_a(), good_b()]), None, "'inputs'", "limit of 1", max_inputs=1)
    rejects(
        json_request([good_a(name="a" * 20), good_b()]),
        None,
        "inputs[0]",
        "'name'",
        "longer than 10",
        max_string_length=10,
    )
    rejects(
        json_request([good_a(), good_b()], id="x" * 11),
        None,
        "'id'",
        "longer than 10",
        max_string_length=10,
    )


def test_batch_sizes_must_agree() -> None:
    rejects(
        json_request([good_a(), good_b(shape=[2, 1])]),
        None,
        "[request id: <id_unknown>] input 'b' batch size does not match other inputs for 'two'",
        "2 here, 1 in input 'a'",
    )


def test_unbatched_rank_and_dims() -> None:
    body = json_request([{"name": "x", "shape": [1, 2, 4], "datatype": "FP32", "data": [0] * 8}])
    message = rejects(
        body,
        None,
        "unexpected shape for input 'x' for model 'fixed'. Expected [-1,4], got [1,2,4]. ",
        config=FIXED,
    )
    assert "NOTE" not in message  # Triton's batch note is for batching models only
    body = json_request([{"name": "x", "shape": [2, 3], "datatype": "FP32", "data": [0] * 6}])
    rejects(body, None, "Expected [-1,4], got [2,3]", config=FIXED)


def test_element_limit() -> None:
    body = json_request([{"name": "x", "shape": [5, 4], "datatype": "FP32", "data": [0] * 20}])
    rejects(body, None, "input 'x'", "20 elements", "limit of 16", config=FIXED, max_elements=16)


@pytest.mark.parametrize(
    ("datatype", "data", "fragments"),
    [
        (
            "FP32",
            [1, 2, 3],
            (
                "Unable to parse 'data': Shape does not match true shape of 'data' field",
                "shape [1,4] needs 4 elements, got 3",
            ),
        ),
        ("FP32", 5, ("'data' must be a list", "integer")),
        ("FP32", ["1", "2", "3", "4"], ("FP32 data must be numbers", "strings")),
        ("FP32", [1, "2", 3, 4], ("FP32 data must be numbers", "strings")),
        ("FP32", [1, None, 3, 4], ("FP32 data must be numbers", "null")),
        ("FP32", [1, {"v": 2}, 3, 4], ("FP32 data must be numbers", "object")),
        ("FP32", [1, 2, 3, True], None),  # mixed bool/number: numpy coerces, accepted
        ("FP32", [True, False, True, True], ("FP32 data must be numbers", "booleans")),
        ("FP32", [1e300, 0, 0, 0], ("out of range for FP32",)),
        ("FP16", [70000, 0, 0, 0], ("out of range for FP16",)),
        ("INT32", [1.5, 2, 3, 4], ("INT32 data must be integers", "non-integer")),
        ("INT32", [True, False, True, False], ("INT32 data must be integers", "booleans")),
        ("INT8", [1, 2, 300, 4], ("value 300 is out of range for INT8",)),
        ("UINT8", [1, -1, 3, 4], ("value -1 is out of range for UINT8",)),
        ("INT64", [1 << 63, 0, 0, 0], ("value 9223372036854775808 is out of range for INT64",)),
        ("UINT64", [-1, 1 << 63, 0, 0], ("value -1 is out of range for UINT64",)),
        ("UINT64", [1.0, 1 << 63, 0, 0], ("UINT64 data must be integers", "non-integer")),
        ("INT64", [-1, 2.0**64, 0, 0], ("INT64 data must be integers", "non-integer")),
        ("BOOL", [1, 2, 0, 1], ("BOOL data must be true/false", "other integers")),
        ("BOOL", [0.5, 1, 0, 1], ("BOOL data must be true/false", "non-integer")),
        ("BYTES", ["a", 1, "c", "d"], ("BYTES data must be strings", "integer")),
        (
            "BYTES",
            ["a", "b", "c"],
            (
                "[request id: <id_unknown>] expected 4 string elements for inference input "
                "'INPUT0' for model 'm', got 3",
            ),
        ),
        (
            "BYTES",
            ["a", "b", "c", "d", "e", "f"],
            (
                "unexpected number of string elements 5 for inference input 'INPUT0' for model "
                "'m', expecting 4; the data holds 6",
            ),
        ),
    ],
)
def test_json_data_rejections(datatype: str, data: Any, fragments: tuple[str, ...] | None) -> None:
    body = json_request([{"name": "INPUT0", "shape": [1, 4], "datatype": datatype, "data": data}])
    config = one_input(datatype, (4,))
    if fragments is None:
        parse(body, None, config)
        return
    rejects(body, None, *fragments, config=config)


@pytest.mark.parametrize("nested", [False, True], ids=["flat", "nested"])
def test_a_string_among_numbers_costs_no_more_than_its_bytes(nested: bool) -> None:
    """numpy makes a list holding a string into a fixed-width string array, each element
    as wide as the longest: 50 KB of JSON would take 100 MB (GiBs for a larger body, on
    the event loop below the offload threshold). The types are checked first."""
    data: list[Any] = ["x" * 50_000] + ["y"] * 499
    if nested:
        data = [data[i : i + 10] for i in range(0, 500, 10)]
    body = json_request([{"name": "x", "shape": [500], "datatype": "FP32", "data": data}])
    config = Config("m", 0, (Spec("x", "FP32", (-1,)),), (Spec("y", "FP32", (1,)),))
    tracemalloc.start()
    try:
        rejects(body, None, "input 'x': FP32 data must be numbers, got strings", config=config)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 5_000_000, peak  # (the JSON decoder's own buffers included)


@pytest.mark.parametrize(
    ("datatype", "data", "expected"),
    [
        ("UINT64", [1 << 63, 0, 1, (1 << 64) - 1], [1 << 63, 0, 1, (1 << 64) - 1]),
        ("INT64", [-(1 << 63), (1 << 63) - 1, 0, -1], [-(1 << 63), (1 << 63) - 1, 0, -1]),
        ("INT8", [-128, 127, True, 0], [-128, 127, 1, 0]),
        ("FP16", [65504, -65504, 0.5, 1], [65504, -65504, 0.5, 1]),
        ("FP64", [1, 2.5, [3, [4]]], [1, 2.5, 3, 4]),  # ragged, the first value flat
        ("BOOL", [True, 0, 1, False], [True, False, True, False]),
    ],
)
def test_json_numbers_at_the_edges_of_their_types(
    datatype: str, data: list[Any], expected: list[Any]
) -> None:
    body = json_request([{"name": "INPUT0", "shape": [1, 4], "datatype": datatype, "data": data}])
    request = parse(body, None, one_input(datatype, (4,)))
    assert decoded(request).ravel().tolist() == expected


def test_a_value_of_another_type_after_a_list_is_named() -> None:
    body = json_request(
        [{"name": "INPUT0", "shape": [1, 4], "datatype": "INT32", "data": [1, [2, "3"], 4]}]
    )
    rejects(body, None, "INT32 data must be integers, got strings", config=one_input("INT32", (4,)))


def test_json_depth_limit_regular_and_ragged() -> None:
    def nest(value: Any, levels: int) -> Any:
        for _ in range(levels):
            value = [value]
        return value

    config = Config("m", 0, (Spec("x", "FP32", (-1, -1)),), (Spec("y", "FP32", (1,)),))
    ok = json_request([{"name": "x", "shape": [1, 1], "datatype": "FP32", "data": nest(1.0, 4)}])
    parse(ok, None, config, max_json_depth=4)
    deep = json_request([{"name": "x", "shape": [1, 1], "datatype": "FP32", "data": nest(1.0, 5)}])
    rejects(deep, None, "input 'x'", "nested deeper than 4", config=config, max_json_depth=4)
    very_deep = json_request(
        [{"name": "x", "shape": [1, 1], "datatype": "FP32", "data": nest(1.0, 200)}]
    )
    rejects(very_deep, None, "input 'x'", "nested deeper than 100", config=config)
    ragged = json_request(
        [{"name": "x", "shape": [1, 2], "datatype": "FP32", "data": [1.0, nest(2.0, 5)]}]
    )
    rejects(ragged, None, "input 'x'", "nested deeper than 4", config=config, max_json_depth=4)
    strings = json_request(
        [{"name": "INPUT0", "shape": [1, 1], "datatype": "BYTES", "data": nest("s", 5)}]
    )
    rejects(
        strings, None, "nested deeper than 4", config=one_input("BYTES", (1,)), max_json_depth=4
    )


def binary_request(inputs: list[dict[str, Any]], *chunks: bytes, **extra: Any) -> tuple[bytes, int]:
    header = json_request(inputs, **extra)
    return header + b"".join(chunks), len(header)


def binary_a(size: int = 16) -> dict[str, Any]:
    return {
        "name": "a",
        "shape": [1, 4],
        "datatype": "FP32",
        "parameters": {"binary_data_size": size},
    }


def test_binary_size_must_match_shape() -> None:
    body, size = binary_request([binary_a(12), good_b()], b"\x00" * 12)
    rejects(body, size, "input 'a'", "binary_data_size is 12", "shape [1,4] of FP32 needs 16 bytes")


def test_binary_data_missing_or_extra() -> None:
    body, size = binary_request([binary_a(), good_b()], b"\x00" * 10)
    rejects(body, size, "input 'a'", "binary_data_size 16 exceeds the 10 bytes")
    body, size = binary_request([binary_a(), good_b()], b"\x00" * 20)
    rejects(body, size, "4 bytes after the JSON header")
    body, size = binary_request([good_a(), good_b()], b"junk")
    rejects(body, size, "4 bytes after the JSON header")
    body = json_request([binary_a(), good_b()])
    rejects(body, None, "input 'a'", "exceeds the 0 bytes", "Inference-Header-Content-Length")


def test_binary_bytes_must_be_well_formed() -> None:
    c = {"name": "c", "shape": [1, 1], "datatype": "BYTES", "parameters": {"binary_data_size": 6}}
    body, size = binary_request([good_a(), good_b(), c], struct.pack("<I", 5) + b"ab")
    rejects(body, size, "input 'c'", "truncated")
    two = serialize_bytes([b"x", b"y"])
    c["parameters"] = {"binary_data_size": len(two)}
    body, size = binary_request([good_a(), good_b(), c], two)
    rejects(
        body,
        size,
        "[request id: <id_unknown>] unexpected number of string elements 2 for inference input "
        "'c' for model 'two', expecting 1; the data holds 2",
    )


@pytest.mark.parametrize(
    ("outputs", "fragments"),
    [
        ({"name": "x"}, ("request 'outputs'", "list")),
        ([5], ("outputs[0]", "object")),
        ([{}], ("outputs[0]", "'name'", "required")),
        ([{"name": 1}], ("outputs[0]", "'name'", "string")),
        ([{"name": "w"}], ("unexpected inference output 'w' for model 'two'", "'x', 'y', 'z'")),
        (
            [{"name": "x"}, {"name": "x"}],
            ("[request id: <id_unknown>] output 'x' already exists in request",),
        ),
        ([{"name": "x", "parameters": 1}], ("output 'x'", "'parameters'", "object")),
        (
            [{"name": "x", "parameters": {"binary_data": 1}}],
            ("Unable to parse 'binary_data': attempt to access JSON non-boolean", "output 'x'"),
        ),
        (
            [{"name": "z", "parameters": {"classification": 3}}],
            ("class result not available for output due to unsupported type 'BYTES'", "'z'"),
        ),
        (
            [{"name": "x", "parameters": {"classification": "3"}}],
            ("Unable to set 'classification': attempt to access JSON non-unsigned", "'x'"),
        ),
        (
            [{"name": "x", "parameters": {"classification": -1}}],
            ("Unable to set 'classification': attempt to access JSON non-unsigned", "'x'"),
        ),
        (
            [
                {
                    "name": "x",
                    "parameters": {
                        "classification": 2,
                        "shared_memory_region": "r",
                        "shared_memory_byte_size": 8,
                    },
                }
            ],
            ("Output can't set both 'shared_memory_region' and 'classification'",),
        ),
        (
            [{"name": "x", "parameters": {"shared_memory_region": "r"}}],
            (
                "'shared_memory_byte_size' must be specified along with 'shared_memory_region' "
                "parameter for tensor 'x'",
            ),
        ),
    ],
)
def test_output_rejections(outputs: Any, fragments: tuple[str, ...]) -> None:
    rejects(json_request([good_a(), good_b()], outputs=outputs), None, *fragments)


def test_tritonclient_classification_request() -> None:
    a = np.zeros((1, 4), np.float32)
    b = np.zeros((1, 1), np.int32)
    outputs = [
        httpclient.InferRequestedOutput("x", class_count=2),
        httpclient.InferRequestedOutput("y", binary_data=False, class_count=7),
        httpclient.InferRequestedOutput("z"),
    ]
    body, size = client_body(
        [triton_input("a", a, "FP32"), triton_input("b", b, "INT32")], outputs=outputs
    )
    request = parse(body, size)
    assert request.outputs == [
        RequestedOutput("x", True, classes=2),
        RequestedOutput("y", False, classes=7, json_asked=True),
        RequestedOutput("z", True),
    ]
    assert request.classes == {"x": 2, "y": 7}


def test_tritonclient_shared_memory_input_needs_a_registered_region() -> None:
    a = httpclient.InferInput("a", [1, 4], "FP32")
    a.set_shared_memory("region0", 16)
    b = triton_input("b", np.zeros((1, 1), np.int32), "INT32")
    body, size = client_body([a, b])
    rejects(body, size, "input 'a'", "unknown shared memory region 'region0'")
