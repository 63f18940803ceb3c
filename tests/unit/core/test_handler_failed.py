"""An error whose status is a model's own (a TorchServe handler's) keeps it between
processes: its kind carries the status, so the gateway answers what the worker said."""

from __future__ import annotations

from http import HTTPStatus

import pytest

from sluice.core.errors import (
    HandlerFailed,
    InferenceFailed,
    SluiceError,
    error_from_kind,
    error_kind,
)


@pytest.mark.parametrize(
    ("code", "status", "grpc_code"),
    [
        (503, 503, "UNAVAILABLE"),
        (422, 422, "INTERNAL"),
        (404, 404, "NOT_FOUND"),
        (507, 507, "RESOURCE_EXHAUSTED"),
        (200, 500, "INTERNAL"),  # (no error can be a success)
        (299, 500, "INTERNAL"),  # (no status at all)
    ],
)
def test_a_handler_s_status_travels_with_its_error(code: int, status: int, grpc_code: str) -> None:
    error = HandlerFailed("no such thing", code)
    assert (int(error.status), error.grpc_code) == (status, grpc_code)
    again = error_from_kind(error_kind(error), error.message)
    assert isinstance(again, HandlerFailed) and isinstance(again, InferenceFailed)
    assert (again.status, again.grpc_code, again.message) == (
        error.status,
        grpc_code,
        "no such thing",
    )


def test_a_kind_that_names_no_status_is_the_root_error() -> None:
    for kind in ("HandlerFailed:abc", "HandlerFailed:4222", "HandlerFailed", "Other:503"):
        error = error_from_kind(kind, "why")
        assert type(error) is SluiceError and error.status == HTTPStatus.INTERNAL_SERVER_ERROR
    assert error_kind(InferenceFailed("x")) == "InferenceFailed"
