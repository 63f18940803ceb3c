"""The generate extension's request turned into a KServe v2 request."""

from __future__ import annotations

import pytest

from sluice.core.config import parse_config_text
from sluice.core.errors import InvalidInput
from sluice.gateway.http.generate_routes import generate_document


def _config(dims: str, max_batch_size: int = 4) -> object:
    return parse_config_text(
        f'backend: "python"\nmax_batch_size: {max_batch_size}\n'
        f'input [ {{ name: "x" data_type: TYPE_FP32 dims: [ {dims} ] }}, '
        '{ name: "mode" data_type: TYPE_STRING dims: [ 1 ] optional: true } ]\n'
        'output [ { name: "y" data_type: TYPE_FP32 dims: [ 1 ] } ]\n',
        model_name="m",
    )


def test_values_take_the_input_s_shape_and_other_keys_become_parameters() -> None:
    document = generate_document(
        {"x": [[1, 2, 3], [4, 5, 6]], "stream": False, "parameters": {"temperature": 0.5}},
        _config("2, -1"),  # type: ignore[arg-type]
    )
    assert document["inputs"] == [
        {"name": "x", "datatype": "FP32", "shape": [1, 2, 3], "data": [1, 2, 3, 4, 5, 6]}
    ]
    assert document["parameters"] == {"stream": False, "temperature": 0.5}
    by_parameter = generate_document({"parameters": {"x": 7}}, _config("1", 0))  # type: ignore[arg-type]
    assert by_parameter["inputs"][0]["shape"] == [1] and "parameters" not in by_parameter


def test_two_variable_dimensions_cannot_be_filled() -> None:
    with pytest.raises(InvalidInput, match="can fill one variable dimension only"):
        generate_document({"x": [1, 2, 3, 4]}, _config("-1, -1"))  # type: ignore[arg-type]


def test_a_value_nested_as_deep_as_json_allows_is_refused_without_recursion() -> None:
    """A value is flattened as ``/infer``'s ``data`` is: past Triton's depth limit (100)
    a 400 naming the input, where the recursive flattening crashed (RecursionError, a 500)
    on nesting the JSON parser accepts (up to 1024 levels)."""
    value: object = 1.0
    for _ in range(1000):
        value = [value]
    with pytest.raises(InvalidInput, match="input 'x': 'data' is nested deeper than 100 levels"):
        generate_document({"x": value}, _config("-1"))  # type: ignore[arg-type]
    ragged: object = [1.0, [2.0, [3.0]]]
    assert generate_document({"x": ragged}, _config("-1"))["inputs"][0]["data"] == [1, 2, 3]  # type: ignore[arg-type]
