"""TorchServe workflow archives and specifications (sluice.core.torchserve.workflows): what
a workflow's graph and settings become, and every bad archive or specification refused
naming why."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import pytest

from sluice.core.errors import InvalidConfig, InvalidInput
from sluice.core.torchserve.archives import MANIFEST as MAR_MANIFEST
from sluice.core.torchserve.workflows import (
    MAX_NODES,
    Workflow,
    WorkflowArchive,
    function_archive,
    parse_workflow,
    read_war,
)

PARALLEL = """
models:
  batch-size: 4
  timeout-ms: 2000
  shout:
    url: shout.mar
    batch-size: 8
    retry-attempts: 3
dag:
  pre: [shout, count]
  shout: [join]
  count: [join]
"""


def archive(spec: str, handler: str = "handler.py") -> WorkflowArchive:
    files = {"spec.yaml": spec.encode(), "handler.py": b"def pre(data, context): ..."}
    return WorkflowArchive("words", spec, handler, files)


def write_war(path: Path, members: dict[str, str | bytes]) -> Path:
    with zipfile.ZipFile(path, "w") as war:
        for name, data in members.items():
            war.writestr(name, data)
    return path


def manifest(**workflow: str) -> str:
    return json.dumps({"createdOn": "x", "archiverVersion": "0.2.15", "workflow": workflow})


def test_a_graph_with_parallel_branches_becomes_nodes_served_as_models() -> None:
    workflow = parse_workflow(archive(PARALLEL), "words.war")
    assert list(workflow.nodes) == ["pre", "shout", "count", "join"]
    assert workflow.start == "pre" and workflow.leaves == ("join",)
    assert workflow.parents("join") == ("shout", "count")
    shout, pre = workflow.nodes["shout"], workflow.nodes["pre"]
    assert (shout.model, shout.url, shout.batch_size, shout.retry_attempts) == (
        "words__shout",
        "shout.mar",
        8,
        3,
    )
    assert shout.timeout_ms == 2000  # (the setting for every model)
    # A function: one worker, batches of one, the workflow's retries and time limit.
    assert (pre.url, pre.batch_size, pre.min_workers, pre.timeout_ms) == (None, 1, 1, 2000)
    assert workflow.dag == "{pre=[shout, count], shout=[join], count=[join], join=[]}"
    assert workflow.settings["batch-size"] == 4 and workflow.settings["max-batch-delay"] == 50
    assert Workflow.from_json(workflow.to_json()) == workflow


def test_a_name_given_at_registration_names_the_workflow_and_its_models() -> None:
    workflow = parse_workflow(archive(PARALLEL), "words.war", "other")
    assert workflow.name == "other" and workflow.nodes["join"].model == "other__join"


@pytest.mark.parametrize(
    ("spec", "reason"),
    [
        ("dag: [a]", "needs a 'dag' section"),
        ("models: []\ndag: {a: [b]}", "'models' must map"),
        ("dag:\n  a: [b]\n  c: [b]", "DAG should have only one start node"),
        ("dag:\n  a: [b]\n  b: [c]\n  c: [b]", "Not a valid DAG"),
        ("dag:\n  a: [a]", "'a' feeds itself"),
        ("dag:\n  a: b", "'a' must map to a list of node names"),
        ("dag:\n  1: [b]", "a node of 'dag' must be named"),
        ("models:\n  batch-size: 0\ndag:\n  a: [b]", "'batch-size' must be a whole number"),
        ("models:\n  timeout-ms: x\ndag:\n  a: [b]", "'timeout-ms' must be a whole number"),
        (
            "models:\n  retry-attempts: 11\ndag:\n  a: [b]",
            "'retry-attempts' must be a whole number from 0 to 10",
        ),
        ("models:\n  m: {batch-size: 2}\ndag:\n  m: [b]", "model 'm' needs a 'url'"),
        ("dag:\n  a-b: [c]", "node 'a-b' names no Python function"),
        ("dag: {a: [b", "is not YAML"),
        ("dag:\n  a: [" + ", ".join(f"n{i}" for i in range(MAX_NODES + 1)) + "]", "more than"),
    ],
)
def test_a_bad_specification_is_refused_naming_why(spec: str, reason: str) -> None:
    with pytest.raises(InvalidInput) as refused:
        parse_workflow(archive(spec), "w.war")
    assert refused.value.message.startswith("Invalid workflow specification: ")
    assert reason in refused.value.message


def test_a_function_needs_the_handler_file() -> None:
    with pytest.raises(InvalidInput, match="the archive has no handler file"):
        parse_workflow(archive("dag:\n  a: [b]", handler=""), "w.war")


@pytest.mark.parametrize("name", ["../x", "a/b", "a b", "x" * 200])
def test_a_node_or_workflow_name_that_cannot_be_a_model_name_is_refused(name: str) -> None:
    with pytest.raises(InvalidConfig, match="cannot be a folder name"):
        parse_workflow(archive(f"dag:\n  '{name}': [b]"), "w.war")
    with pytest.raises(InvalidConfig, match="cannot be a folder name"):
        parse_workflow(archive("dag:\n  a: [b]"), "w.war", name)


@pytest.mark.parametrize("name", [".", "..", ".hidden"])
def test_a_workflow_name_that_would_be_a_hidden_folder_is_refused(name: str) -> None:
    """(Its node models would be ``..__a``: a folder the repository's scan passes over.)"""
    with pytest.raises(InvalidConfig, match="cannot be a folder name"):
        parse_workflow(archive("dag:\n  a: [b]"), "w.war", name)


def test_an_archive_is_read_with_its_manifest_specification_and_files(tmp_path: Path) -> None:
    path = write_war(
        tmp_path / "w.war",
        {
            "WAR-INF/MANIFEST.json": manifest(
                workflowName="w", specFile="spec.yaml", handler="handler.py"
            ),
            "spec.yaml": PARALLEL,
            "handler.py": "def pre(data, context): ...",
            "data/vocab.txt": "a b",
        },
    )
    read = read_war(path)
    assert (read.name, read.handler, read.spec) == ("w", "handler.py", PARALLEL)
    assert set(read.files) == {"spec.yaml", "handler.py", "data/vocab.txt"}


@pytest.mark.parametrize(
    ("members", "reason"),
    [
        ({"spec.yaml": "dag: {}"}, "WAR-INF/MANIFEST.json is missing"),
        ({"WAR-INF/MANIFEST.json": "{"}, "is not JSON"),
        ({"WAR-INF/MANIFEST.json": "[]"}, "Missing Workflow entry in manifest file."),
        ({"WAR-INF/MANIFEST.json": manifest(specFile="s.yaml")}, "Workflow name is not defined"),
        ({"WAR-INF/MANIFEST.json": manifest(workflowName="w", specFile="s.yaml")}, "specFile"),
        (
            {
                "WAR-INF/MANIFEST.json": manifest(
                    workflowName="w", specFile="s.yaml", handler="h.py"
                ),
                "s.yaml": "dag: {}",
            },
            "handler 'h.py' is not in the archive",
        ),
        ({"../../escape.py": "x"}, "points outside the archive"),
        ({"/etc/passwd": "x"}, "points outside the archive"),
        (
            {
                "WAR-INF/MANIFEST.json": manifest(workflowName="w", specFile="s.yaml"),
                "s.yaml": b"\xff\xfe",
            },
            "is not UTF-8 text",
        ),
    ],
)
def test_a_bad_archive_is_refused_naming_why(
    tmp_path: Path, members: dict[str, str | bytes], reason: str
) -> None:
    path = write_war(tmp_path / "bad.war", members)
    with pytest.raises((InvalidInput, InvalidConfig)) as refused:
        read_war(path)
    assert reason in refused.value.message


def test_what_is_not_a_zip_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "no.war"
    path.write_bytes(b"not a zip")
    with pytest.raises(InvalidConfig, match="not a readable zip archive"):
        read_war(path)


def test_a_function_is_served_from_an_archive_of_its_own(tmp_path: Path) -> None:
    source = archive(PARALLEL)
    workflow = parse_workflow(source, "words.war")
    made = tmp_path / "pre.mar"
    made.write_bytes(function_archive(source, workflow.nodes["pre"]))
    with zipfile.ZipFile(made) as mar:
        model = json.loads(mar.read(MAR_MANIFEST))["model"]
        assert (model["modelName"], model["handler"]) == ("words__pre", "handler.py:pre")
        assert set(mar.namelist()) == {MAR_MANIFEST, "spec.yaml", "handler.py"}


def _alias_bomb() -> str:
    """YAML whose aliases make a list of 10**8 items from a few lines."""
    lines = ["  a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"  a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 8)]
    return "bombs:\n" + "\n".join(lines) + "\nmodels:\n  batch-size: *a7\ndag:\n  a: [b]\n"


@pytest.mark.parametrize(
    ("spec", "reason"),
    [
        ("dag: {a: [b]}\nx: " + "[" * 20_000 + "]" * 20_000, "nests too deeply"),
        ("models:\n  batch-size: " + "9" * 5000 + "\ndag:\n  a: [b]", "cannot be read"),
        ("models:\n  batch-size: 0x" + "f" * 5000 + "\ndag:\n  a: [b]", "not a huge number"),
        ("models:\n  x: 2020-13-45\ndag:\n  a: [b]", "cannot be read"),
        (_alias_bomb(), "'batch-size' must be a whole number from 1 to 1000000, not a list"),
    ],
)
def test_hostile_yaml_is_refused_at_once_with_a_short_reason(spec: str, reason: str) -> None:
    with pytest.raises(InvalidInput) as refused:
        parse_workflow(archive(spec), "w.war")
    assert reason in refused.value.message and len(refused.value.message) < 300


@pytest.mark.parametrize("handler", ["funcs/handler.py", "handler.txt", "my-handler.py"])
def test_a_handler_file_torchserve_cannot_import_is_refused_for_a_function(
    handler: str,
) -> None:
    with pytest.raises(InvalidInput, match="cannot import: it must be a Python file at the"):
        parse_workflow(archive("dag:\n  pre: [post]", handler=handler), "w.war")


def test_an_archive_of_model_nodes_alone_needs_no_handler(tmp_path: Path) -> None:
    path = write_war(
        tmp_path / "m.war",
        {
            "WAR-INF/MANIFEST.json": manifest(workflowName="m", specFile="s.yaml"),
            "s.yaml": "models:\n  a: {url: a.mar}\n  b: {url: b.mar}\ndag:\n  a: [b]\n",
        },
    )
    workflow = parse_workflow(read_war(path), "m.war")
    assert [node.url for node in workflow.nodes.values()] == ["a.mar", "b.mar"]
