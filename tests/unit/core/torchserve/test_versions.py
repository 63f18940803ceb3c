"""TorchServe's model versions as Sluice's numbered ones, and the configuration an archive
is served with (versions, workers, device)."""

from __future__ import annotations

import pytest

from sluice.core.config import parse_config_text
from sluice.core.errors import InvalidConfig, InvalidInput
from sluice.core.torchserve.config import check_model_name, triton_config
from sluice.core.torchserve.versions import (
    VersionRecord,
    decimal_of,
    find,
    number_for,
    record_of,
    without_version,
)


def test_whole_versions_keep_their_number_and_others_take_the_next() -> None:
    assert number_for("1.0", {}, "a.mar") == 1
    assert number_for("2", {1: "1.0"}, "a.mar") == 2
    assert number_for("1.5", {1: "1.0", 2: "2.0"}, "a.mar") == 3
    assert number_for("3.0", {1: "1.0", 3: "1.5"}, "a.mar") == 4  # 3 is taken


@pytest.mark.parametrize("version", ["v2", "1.2.1", "2024-01", "0.0", "0", "-1", "1e3", "ünï"])
def test_any_text_is_a_version_as_in_torchserve(version: str) -> None:
    """TorchServe takes any text as a version (model-archiver's ``--version`` too); one that
    is no whole positive number takes the next free folder."""
    assert number_for(version, {}, "a.mar") == 1
    assert number_for(version, {1: "1.0", 4: "4.0"}, "a.mar") == 5


@pytest.mark.parametrize(
    ("version", "why"),
    [
        ("1\n2", "control character"),
        ("1\x00", "control character"),
        ("v\x7f", "control character"),
        ("a\u2028b", "line separator"),
        ("\ud800", "control character"),
        ("1/2", "path separator"),
        ("..\\x", "path separator"),
        ("9" * 129, "longer than 128 characters"),
    ],
)
def test_a_version_that_cannot_travel_safely_is_refused_by_name(version: str, why: str) -> None:
    with pytest.raises(InvalidInput, match=rf"a\.mar: model version .*{why}") as refused:
        number_for(version, {}, "a.mar")
    assert repr(version[:128]) in refused.value.message
    assert number_for("9" * 128, {}, "a.mar") == 1  # (a whole number this long is no folder)


def test_a_version_is_found_by_its_text_as_torchserve_finds_it() -> None:
    """TorchServe keys a model's versions by their text: ``1`` and ``1.0`` are two."""
    served = {1: "1.0", 3: "1.5", 4: "v1.x"}
    assert find("1.0", served) == 1 and find("1.5", served) == 3 and find("v1.x", served) == 4
    assert find("1", served) is None and find("1.00", served) is None
    assert find("0.0", served) is None and find("2.0", served) is None
    assert decimal_of(" 2.0 ") == decimal_of("2") and decimal_of("nan") is None


def test_a_version_of_the_same_value_takes_another_number() -> None:
    """``2`` beside ``2.0`` is a version of its own, laid out in a folder of its own."""
    assert find("2", {2: "2.0"}) is None
    assert number_for("2", {1: "1.0", 2: "2.0"}, "a.mar") == 3
    assert number_for("2.0", {2: "2"}, "a.mar") == 3


def test_records_live_in_the_parameters() -> None:
    record = VersionRecord("1.5", "m.tar.gz", "other.py")
    parameters = record.parameters(3)
    assert record_of(parameters, 3) == record
    assert record_of({}, 2) == VersionRecord("2.0")
    assert without_version({**parameters, "x": "y"}, 3) == {"x": "y"}


def test_the_config_serves_each_version_with_its_record() -> None:
    text = triton_config(
        "m",
        4,
        20,
        workers=2,
        max_workers=5,
        gpu=True,
        versions={1: VersionRecord("1.0", "m.mar"), 3: VersionRecord("1.5", 'odd "name".mar')},
    )
    config = parse_config_text(text, model_name="m")
    assert config.version_policy.kind == "specific" and config.version_policy.versions == (1, 3)
    assert config.instance_groups[0].count == 2 and config.instance_groups[0].kind == "KIND_GPU"
    assert config.parameters["sluice.min_instances"] == "2"
    assert config.parameters["sluice.max_instances"] == "5"
    assert record_of(config.parameters, 3).url == 'odd "name".mar'
    fixed = parse_config_text(triton_config("m", workers=3), model_name="m")
    assert fixed.instance_groups[0].count == 3 and "sluice.max_instances" not in fixed.parameters


def test_no_workers_means_one_that_stops_when_idle() -> None:
    config = parse_config_text(triton_config("m", workers=0), model_name="m")
    assert config.instance_groups[0].count == 1
    assert (
        config.parameters["sluice.min_instances"],
        config.parameters["sluice.max_instances"],
    ) == (
        "0",
        "1",
    )


@pytest.mark.parametrize(
    ("kwargs", "reason"),
    [
        ({"workers": -1}, "minWorkers must be a whole number of at least 0"),
        ({"workers": 3, "max_workers": 2}, "maxWorkers must be a whole number from minWorkers"),
        ({"max_workers": 257}, "to 256, got 257"),
        ({"response_timeout_s": -1}, "responseTimeout must be"),
    ],
)
def test_bad_settings_are_refused_by_name(kwargs: dict[str, int], reason: str) -> None:
    with pytest.raises(InvalidConfig, match=reason):
        triton_config("m", **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["../escape", "a/b", "", "x" * 129, "white space"])
def test_names_that_cannot_be_a_folder_are_refused(name: str) -> None:
    with pytest.raises(InvalidConfig, match="cannot be a folder name"):
        check_model_name(name, "a.mar")
