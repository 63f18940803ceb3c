"""TorchServe's config.properties and the request/answer shapes its handlers expect."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import pytest

from sluice.cli.mar_import import import_archives, parse_properties, read_store_settings
from sluice.core.config import parse_config_text
from sluice.core.errors import InvalidConfig
from sluice.core.mar import MANIFEST, triton_config
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
    assert settings.response_timeout_s == 30
    assert settings.ignored == ["models.a.maxWorkers", "number_of_netty_threads"]


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


def _mar(path: Path, name: str) -> Path:
    manifest = {"model": {"modelName": name, "handler": "h.py"}}
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(MANIFEST, json.dumps(manifest))
        archive.writestr("h.py", "def handle(data, context):\n    return data\n")
    return path


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
