"""A TorchServe model store in its other forms, laid out by ``sluice import-mar`` and served
by a real stack: a ``.tar.gz`` and an unarchived folder (both made by the real
``torch-model-archiver``) as two versions of one model, its ``model-config.yaml`` applied,
and a handler that opens a file of its archive by a relative path, as TorchServe runs
handlers in the model's folder."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from sluice.scheduler.executor.redis_server import RedisServer
from tests.support.stack import Stack
from tests.support.torchserve_archives import import_mar, make_archive

WORDS_HANDLER = '''
import os

from wordlist import clean


class WordsHandler:
    """The answer to "2" is the third word of vocab.txt, an extra file of the archive that
    initialize opens by a relative path (and wordlist.py, another, is imported)."""

    def initialize(self, context):
        with open("vocab.txt") as f:
            self.words = [clean(line) for line in f if line.strip()]
        self.in_model_dir = os.path.samefile(
            os.getcwd(), context.system_properties.get("model_dir")
        )
        self.version = context.manifest["model"]["modelVersion"]
        self.greeting = (context.model_yaml_config.get("handler") or {}).get("greeting")
        self.initialized = True

    def handle(self, data, context):
        answers = []
        for request in data:
            body = request.get("body")
            text = body.decode() if isinstance(body, (bytes, bytearray)) else str(body)
            answers.append(
                {
                    "word": self.words[int(text)],
                    "in_model_dir": self.in_model_dir,
                    "version": self.version,
                    "greeting": self.greeting,
                }
            )
        return answers
'''
WORDLIST = "def clean(line):\n    return line.strip().lower()\n"
MODEL_CONFIG = (
    "minWorkers: 1\nmaxWorkers: 2\nbatchSize: 4\nmaxBatchDelay: 30\nresponseTimeout: 60\n"
    "parallelType: pp\nhandler:\n  greeting: hello\n"
)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("forms")
    store = tmp / "store"
    make_archive(
        store,
        "words",
        WORDS_HANDLER,
        version="1.0",
        extra={"vocab.txt": "Alpha\nBeta\nGamma\n", "wordlist.py": WORDLIST},
        config=MODEL_CONFIG,
        archive_format="tgz",
    )
    make_archive(
        store,
        "words",
        WORDS_HANDLER,
        version="2.0",
        extra={"vocab.txt": "Uno\nDos\nTres\n", "wordlist.py": WORDLIST},
        config=MODEL_CONFIG,
        archive_format="no-archive",
        file_name="words-v2",
    )
    repository = tmp / "repository"
    imported = import_mar(str(store), "--model-repository", str(repository))
    assert imported.returncode == 0, imported.stderr
    assert "model 'words' ->" in imported.stdout
    (ignored,) = [line for line in imported.stderr.splitlines() if "model-config.yaml" in line]
    assert "model 'words'" in ignored and ignored.split("ignored: ")[1].startswith("parallelType (")
    assert sorted(p.name for p in (repository / "words").iterdir()) == ["1", "2", "config.pbtxt"]
    stack = Stack(repository, redis_server.url)
    stack.start()
    yield stack
    stack.stop()


def test_a_handler_reads_its_archive_s_files_by_relative_path(stack: Stack) -> None:
    with httpx.Client(base_url=stack.url, timeout=30) as http:
        first = http.post("/predictions/words/1.0", content="2")
        assert first.status_code == 200, first.text
        assert first.json() == {
            "word": "gamma",
            "in_model_dir": True,
            "version": "1.0",
            "greeting": "hello",
        }
        second = http.post("/predictions/words/2.0", content="0")
        assert second.status_code == 200, second.text
        assert (second.json()["word"], second.json()["version"]) == ("uno", "2.0")
        assert http.post("/predictions/words/2.0", content="1").json()["word"] == "dos"
        assert http.post("/predictions/words/2", content="1").status_code == 404  # (not 2.0)
        assert http.post("/predictions/words", content="1").json()["version"] == "2.0"


def test_the_versions_carry_the_archive_s_model_config(stack: Stack) -> None:
    described = httpx.get(f"{stack.url}/models/words/all", timeout=30)
    assert described.status_code == 200, described.text
    versions = {d["modelVersion"]: d for d in described.json()}
    assert sorted(versions) == ["1.0", "2.0"]
    assert versions["1.0"]["modelUrl"] == "words.tar.gz"
    assert versions["2.0"]["modelUrl"] == "words-v2"
    for description in versions.values():
        assert description["batchSize"] == 4 and description["maxBatchDelay"] == 30
        assert (description["minWorkers"], description["maxWorkers"]) == (1, 2)
        assert description["responseTimeout"] == 60 and description["deviceType"] == "cpu"
        assert [w["status"] for w in description["workers"]] == ["READY"]
