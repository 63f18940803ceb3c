"""Triton's restricted APIs (:mod:`sluice.core.restricted_api`): the setting's groups, the
categories of Triton's endpoints and methods, and Triton's refusal texts."""

from __future__ import annotations

import pytest

from sluice.core.restricted_api import (
    GRPC_PREFIX,
    Restriction,
    denial,
    grpc_category,
    http_category,
    parse_restrictions,
)


def test_groups_name_categories_a_header_and_its_value() -> None:
    found = parse_restrictions("model-repository, shared-memory:Admin-Key=s3=cret; health:k=")
    assert found == {
        "model-repository": Restriction("admin-key", "s3=cret"),
        "shared-memory": Restriction("admin-key", "s3=cret"),
        "health": Restriction("k", ""),
    }
    assert parse_restrictions("") == {}


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("models:k=v", "unknown API category 'models'"),
        ("health", "<header>=<value>"),
        ("health:=v", "<header>=<value>"),
        ("health:k=v;health:j=w", "more than one group"),
        # Values and names no request can carry would lock their categories for good.
        ("health:admin-key= secret", "without spaces at either end"),
        ("health:admin-key=s\u00e9cret", "printable ASCII"),
        ("health:admin-key=se\tcret", "printable ASCII"),
        ("health:admin key=secret", "'admin key' is not one a request can carry"),
    ],
)
def test_a_bad_setting_says_what_is_wrong(text: str, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        parse_restrictions(text)


@pytest.mark.parametrize(
    ("path", "category"),
    [
        ("/v2", "metadata"),
        ("/v2/health/ready", "health"),
        ("/v2/models/m/ready", "health"),
        ("/v2/models/m/versions/2/ready", "health"),
        ("/v2/models/ready", "metadata"),  # (a model named "ready")
        ("/v2/models/m", "metadata"),
        ("/v2/models/m/versions/2", "metadata"),
        # A label names a version: its routes are in their versions' categories, whatever
        # the label is called.
        ("/v2/models/m/labels/stable", "metadata"),
        ("/v2/models/m/labels/infer", "metadata"),
        ("/v2/models/m/labels/config", "metadata"),
        ("/v2/models/m/labels/stable/ready", "health"),
        ("/v2/models/m/labels/stable/infer", "inference"),
        ("/v2/models/m/infer", "inference"),
        ("/v2/models/m/versions/2/generate_stream", "inference"),
        ("/v2/models/m/config", "model-config"),
        ("/v2/models/stats", "statistics"),
        ("/v2/models/m/versions/2/stats", "statistics"),
        ("/v2/repository/index", "model-repository"),
        ("/v2/repository/models/m/load", "model-repository"),
        ("/v2/systemsharedmemory/status", "shared-memory"),
        ("/v2/cudasharedmemory/region/r/unregister", "shared-memory"),
        ("/v2/trace/setting", "trace"),
        ("/v2/models/m/trace/setting", "trace"),
        ("/v2/logging", "logging"),
        ("/metrics", None),
        ("/v2/jobs", None),
        ("/predictions/m", None),
    ],
)
def test_http_paths_fall_in_tritons_categories(path: str, category: str | None) -> None:
    assert http_category(path) == category


def test_grpc_methods_fall_in_tritons_categories() -> None:
    assert grpc_category("ModelStreamInfer") == "inference"
    assert grpc_category("RepositoryModelLoad") == "model-repository"
    assert grpc_category("ModelReady") == "health"
    assert grpc_category("Unknown") is None


def test_the_refusal_names_the_header_as_triton_does() -> None:
    restricted = parse_restrictions("model-repository:admin-key=secret")
    repository = "model-repository"
    assert denial(restricted, repository, {}) == (
        "This API is restricted, expecting header 'admin-key'"
    )
    assert denial(restricted, repository, {"admin-key": "wrong"}) is not None
    assert denial(restricted, repository, {"admin-key": "secret"}) is None
    assert denial(restricted, "inference", {}) is None
    assert denial(restricted, None, {}) is None
    assert denial(restricted, repository, {}, GRPC_PREFIX) == (
        "This protocol is restricted, expecting header 'triton-grpc-protocol-admin-key'"
    )
    grpc_headers = {"triton-grpc-protocol-admin-key": "secret"}
    assert denial(restricted, repository, grpc_headers, GRPC_PREFIX) is None


def test_the_value_is_matched_whole_and_every_copy_of_the_header_must_carry_it() -> None:
    """A prefix or an extension of the value is refused; a header given twice passes only
    when both copies carry the value, so that a proxy in front that reads the first, the
    last or both joined cannot disagree with the gateway."""
    restricted = parse_restrictions("model-repository:Admin-Key=secret")
    repository = "model-repository"
    for wrong in ("secre", "secret ", "secrets", "SECRET", ""):
        assert denial(restricted, repository, [("admin-key", wrong)]) is not None, wrong
    assert denial(restricted, repository, [("admin-key", "secret")]) is None
    twice = [("admin-key", "secret"), ("admin-key", "secret")]
    assert denial(restricted, repository, twice) is None
    for pair in (
        [("admin-key", "wrong"), ("admin-key", "secret")],
        [("admin-key", "secret"), ("admin-key", "wrong")],
    ):
        assert denial(restricted, repository, pair) is not None
    assert denial(restricted, repository, [("other", "secret")]) is not None
