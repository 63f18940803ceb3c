"""TorchServe's config.properties and the request/answer shapes its handlers expect."""

from __future__ import annotations

import json
import logging
import shutil
import tarfile
import zipfile
from pathlib import Path

import pytest

from sluice.cli.mar_import import (
    StoreSettings,
    import_archives,
    parse_properties,
    read_store_settings,
)
from sluice.core.config import ModelConfig, parse_config_text
from sluice.core.errors import InvalidConfig, InvalidInput
from sluice.core.torchserve.archives import MANIFEST, triton_config
from sluice.core.torchserve.versions import record_of
from sluice.workers.backends.torchserve_backend import encode_response, request_entry


def test_java_properties_with_comments_separators_and_continuations() -> None:
    text = (
        "# TorchServe\n! also a comment\ninference_address=http://0.0.0.0:8080\n"
        'job_queue_size: 100\nmodels={\\\n  "a": {"1.0": {"batchSize": 4}}\\\n}\n'
    )
    properties = parse_properties(text)
    assert properties["inference_address"] == "http://0.0.0.0:8080"
    assert properties["job_queue_size"] == "100"
    assert json.loads(properties["models"]) == {"a": {"1.0": {"batchSize": 4}}}


def test_store_settings_take_what_has_an_equivalent_and_name_the_rest(tmp_path: Path) -> None:
    models = {
        "a": {
            "1.0": {"batchSize": 4, "maxBatchDelay": 10},
            "2.0": {"defaultVersion": True, "batchSize": 16, "minWorkers": 2, "maxWorkers": 4},
        }
    }
    path = tmp_path / "config.properties"
    path.write_text(
        f"models={json.dumps(models)}\ndefault_response_timeout=30\nnumber_of_netty_threads=4\n"
    )
    settings = read_store_settings(path)
    assert settings.models["a"]["batchSize"] == 16  # the default version's
    assert settings.versions == {"a": "2.0"}
    assert settings.response_timeout_s == 30
    assert settings.ignored == ["number_of_netty_threads"]


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("job_queue_size=lots\n", "job_queue_size must be a whole number"),
        ("models={not json\n", "models is not JSON"),
        ("models=[]\n", "models must be a JSON object"),
        ('models={"a": 3}\n', "models.a must map versions"),
    ],
)
def test_bad_properties_say_which_key(tmp_path: Path, text: str, reason: str) -> None:
    path = tmp_path / "config.properties"
    path.write_text(text)
    with pytest.raises(InvalidConfig, match=reason):
        read_store_settings(path)


def _mar(path: Path, name: str, version: str = "1.0", config: str | None = None) -> Path:
    manifest = {"model": {"modelName": name, "handler": "h.py", "modelVersion": version}}
    if config is not None:
        manifest["model"]["configFile"] = "model-config.yaml"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(MANIFEST, json.dumps(manifest))
        archive.writestr("h.py", "def handle(data, context):\n    return data\n")
        if config is not None:
            archive.writestr("model-config.yaml", config)
    return path


def _config(repository: Path, name: str) -> ModelConfig:
    return parse_config_text((repository / name / "config.pbtxt").read_text(), model_name=name)


def test_import_lays_out_the_store_and_refuses_to_overwrite(tmp_path: Path) -> None:
    store = tmp_path / "store"
    store.mkdir()
    _mar(store / "one.mar", "first")
    repository = tmp_path / "repo"
    settings = read_store_settings(None)
    assert import_archives([store], repository, settings) == ["first"]
    assert (repository / "first" / "1" / "model.mar").is_file()
    config = parse_config_text(
        (repository / "first" / "config.pbtxt").read_text(), model_name="first"
    )
    assert config.backend == "torchserve" and config.default_model_filename == "model.mar"
    with pytest.raises(InvalidConfig, match="exists already"):
        import_archives([store], repository, settings)
    assert import_archives([store], repository, settings, force=True) == ["first"]
    _mar(store / "two.mar", "../escape")
    with pytest.raises(InvalidConfig, match="cannot be a folder name"):
        import_archives([store / "two.mar"], repository, settings)
    with pytest.raises(InvalidConfig, match="batchSize must be a whole number of at least 1"):
        triton_config("m", 0)


def test_every_form_of_the_store_is_laid_out_and_one_name_s_archives_are_versions(
    tmp_path: Path,
) -> None:
    """A .mar, a .tar.gz (one folder named after the model, as torch-model-archiver
    writes it) and an unarchived folder; two archives of one name are its two versions."""
    store = tmp_path / "store"
    store.mkdir()
    _mar(store / "one.mar", "first")
    _mar(store / "two-v1.mar", "second", "1.0")
    _mar(tmp_path / "scratch.mar", "second", "2.0")
    unpacked = store / "second-v2"
    with zipfile.ZipFile(tmp_path / "scratch.mar") as archive:
        archive.extractall(unpacked)
    _mar(tmp_path / "third.mar", "third", "1.5")
    with zipfile.ZipFile(tmp_path / "third.mar") as archive:
        archive.extractall(tmp_path / "third")
    with tarfile.open(store / "third.tar.gz", "w:gz") as tar:
        tar.add(tmp_path / "third", arcname="third")
    (store / "README.txt").write_text("not a model")
    repository = tmp_path / "repo"
    names = import_archives([store], repository, read_store_settings(None))
    assert sorted(names) == ["first", "second", "third"]
    second = _config(repository, "second")
    assert second.version_policy.versions == (1, 2)
    assert record_of(second.parameters, 2).url == "second-v2"
    assert (repository / "second" / "2" / "model.mar").is_file()
    third = _config(repository, "third")
    assert third.version_policy.versions == (1,)  # 1.5 takes the first free number
    assert record_of(third.parameters, 1).version == "1.5"
    with zipfile.ZipFile(repository / "third" / "1" / "model.mar") as archive:
        assert set(archive.namelist()) >= {MANIFEST, "h.py"}  # packed from its folder
    assert not [p for p in repository.iterdir() if p.name.startswith(".")]  # no scratch left


def test_one_version_twice_is_refused_naming_both(tmp_path: Path) -> None:
    _mar(tmp_path / "a.mar", "m", "1.0")
    _mar(tmp_path / "b.mar", "m", "1.0")
    with pytest.raises(InvalidConfig, match=r"model 'm' version 1\.0 is in both a\.mar and b\.mar"):
        import_archives(
            [tmp_path / "a.mar", tmp_path / "b.mar"], tmp_path / "repo", StoreSettings()
        )


def test_versions_of_one_value_are_two_versions(tmp_path: Path) -> None:
    """TorchServe keys versions by their text: ``1`` beside ``1.0`` is a version of its own,
    laid out in a folder of its own."""
    _mar(tmp_path / "a.mar", "m", "1.0")
    _mar(tmp_path / "b.mar", "m", "1")
    import_archives([tmp_path / "a.mar", tmp_path / "b.mar"], tmp_path / "repo", StoreSettings())
    config = _config(tmp_path / "repo", "m")
    assert config.version_policy.versions == (1, 2)
    assert {record_of(config.parameters, n).version for n in (1, 2)} == {"1.0", "1"}


def test_versions_that_are_no_number_are_laid_out_after_the_whole_ones(tmp_path: Path) -> None:
    """TorchServe takes any version text (``v1``, ``2024-01``): each takes the next free
    folder once the whole versions have kept theirs (``v1`` sorts before ``1.0`` by name, and
    still does not take folder 1), and a second ``v1`` is refused as any version twice."""
    sources = [
        _mar(tmp_path / "a.mar", "m", "v1"),
        _mar(tmp_path / "b.mar", "m", "2024-01"),
        _mar(tmp_path / "c.mar", "m", "1.0"),
        _mar(tmp_path / "d.mar", "m", "1.2.1"),
    ]
    import_archives(sources, tmp_path / "repo", StoreSettings())
    config = _config(tmp_path / "repo", "m")
    shown = {n: record_of(config.parameters, n).version for n in config.version_policy.versions}
    assert shown == {1: "1.0", 2: "v1", 3: "2024-01", 4: "1.2.1"}
    assert sorted(p.name for p in (tmp_path / "repo" / "m").iterdir() if p.is_dir()) == [
        "1",
        "2",
        "3",
        "4",
    ]
    _mar(tmp_path / "e.mar", "m", "v1")
    with pytest.raises(InvalidConfig, match=r"version v1 is in both a\.mar and e\.mar"):
        import_archives([*sources, tmp_path / "e.mar"], tmp_path / "again", StoreSettings())


def test_a_version_that_cannot_travel_safely_is_refused(tmp_path: Path) -> None:
    _mar(tmp_path / "a.mar", "m", "1/../2")
    with pytest.raises(InvalidInput, match=r"a\.mar: model version '1/\.\./2' .*path separator"):
        import_archives([tmp_path / "a.mar"], tmp_path / "repo", StoreSettings())
    assert not (tmp_path / "repo" / "m").exists()


def test_the_archive_s_model_config_comes_before_config_properties(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _mar(
        tmp_path / "m.mar",
        "m",
        config="batchSize: 8\nminWorkers: 2\nmaxWorkers: 3\ndeviceType: gpu\nparallelType: pp\n",
    )
    properties = tmp_path / "config.properties"
    models = {"m": {"1.0": {"batchSize": 2, "maxBatchDelay": 7, "responseTimeout": 9}}}
    properties.write_text(f"models={json.dumps(models)}\n")
    with caplog.at_level(logging.WARNING):
        import_archives([tmp_path / "m.mar"], tmp_path / "repo", read_store_settings(properties))
    config = _config(tmp_path / "repo", "m")
    assert config.max_batch_size == 8  # the archive's
    assert config.dynamic_batching is not None
    assert config.dynamic_batching.max_queue_delay_us == 7000  # config.properties'
    assert config.dynamic_batching.default_timeout_us == 9_000_000
    assert config.instance_groups[0].count == 2 and config.instance_groups[0].kind == "KIND_GPU"
    assert config.parameters["sluice.max_instances"] == "3"
    (line,) = [r.getMessage() for r in caplog.records if "model-config.yaml" in r.getMessage()]
    assert "model 'm'" in line and "parallelType" in line


def test_a_bad_model_config_names_the_archive_and_the_key(tmp_path: Path) -> None:
    _mar(tmp_path / "m.mar", "m", config="batchSize: many\n")
    with pytest.raises(InvalidConfig, match=r"m\.mar: model-config\.yaml: batchSize must be"):
        import_archives([tmp_path / "m.mar"], tmp_path / "repo", StoreSettings())
    assert not (tmp_path / "repo" / "m").exists()


def test_sources_that_are_no_model_are_refused(tmp_path: Path) -> None:
    with pytest.raises(InvalidConfig, match="is neither a model archive nor a folder"):
        import_archives([tmp_path / "absent.mar"], tmp_path / "repo", StoreSettings())
    (tmp_path / "empty").mkdir()
    with pytest.raises(InvalidConfig, match="no model found"):
        import_archives([tmp_path / "empty"], tmp_path / "repo", StoreSettings())
    (tmp_path / "x.mar").write_text("not a zip")
    with pytest.raises(InvalidConfig, match=r"x\.mar: neither a \.mar \(zip\) nor a \.tar\.gz"):
        import_archives([tmp_path / "x.mar"], tmp_path / "repo", StoreSettings())
    shutil.rmtree(tmp_path / "repo")


def test_requests_and_answers_take_torchserve_s_shapes() -> None:
    entry, headers = request_entry("application/json", b'{"a": 1}')
    assert entry == {"body": {"a": 1}} and headers["body"]["content-type"] == "application/json"
    assert request_entry("text/plain", b"hi")[0] == {"body": "hi"}
    assert request_entry("image/png", b"\x89PNG")[0] == {"body": bytearray(b"\x89PNG")}
    boundary = "XyZ"
    body = (
        f'--{boundary}\r\nContent-Disposition: form-data; name="data"; filename="a.json"\r\n'
        "Content-Type: application/json\r\n\r\n[1, 2]\r\n"
        f'--{boundary}\r\nContent-Disposition: form-data; name="note"\r\n\r\nraw\r\n'
        f"--{boundary}--\r\n"
    ).encode()
    form, _ = request_entry(f"multipart/form-data; boundary={boundary}", body)
    assert form == {"data": [1, 2], "note": bytearray(b"raw")}
    assert encode_response({"y": [1]}, None) == (b'{"y": [1]}', "application/json")
    assert encode_response("text", None) == (b"text", "text/plain")
    assert encode_response(b"\x00", "image/png") == (b"\x00", "image/png")


def test_an_allowed_url_pattern_that_is_not_a_regular_expression_is_refused_at_start(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from pydantic import ValidationError

    from sluice.core.settings import GatewaySettings

    monkeypatch.setenv("SLUICE_ALLOWED_MODEL_URLS", r"http://ok/.*,http://(")
    with pytest.raises(ValidationError, match="'http://\\(' is not a regular expression"):
        GatewaySettings()
